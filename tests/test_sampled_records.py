"""End to end on loaders as users build them (``sampled_records_models``). A
``WeightedRandomSampler`` draws with replacement, so a batch may hold one record twice: the
report's record ids needed every id of the batch distinct and named no record there. A padding
collate_fn's per-record lengths, 0 for an empty record in the last short batch, were not named:
the hint stayed an eps on the divisor. A batch left as a list of records' vectors had its
samples read along each vector; a list of record dicts named no record by their ids. The
healthy loop, over ``random_split``, ``Subset`` and
``ConcatDataset`` shuffled by a seeded generator across two persistent workers, trains
bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import pytest
import sampled_records_models as M
import torch
from torch.utils.data import ConcatDataset, DataLoader, Subset, random_split

from recorder import FlightRecorder, NonFiniteError
from replay import replay

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def train(out_dir, make, loader, call, record=True) -> list[float]:
    """SGD over ``loader`` for two epochs; ``call(model, batch)``: (output, target)."""
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    criterion = torch.nn.CrossEntropyLoss()
    rec = FlightRecorder(model, opt, loss_fn=criterion, out_dir=out_dir) if record else None
    losses = []
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else criterion
        for _ in range(2):
            for batch in loader:
                opt.zero_grad()
                loss = loss_fn(*call(model, batch))
                loss.backward()
                opt.step()
                losses.append(loss.item())
    return losses


def fire(tmp_path, make, loader, call):
    with pytest.raises(NonFiniteError) as info:
        train(tmp_path, make, loader, call)
    return info.value.event, replay(info.value.bundle_path, factory=make)


def test_a_record_the_sampler_drew_twice_in_its_batch_still_names_the_record(tmp_path):
    """Record 23 (of the rare class the sampler oversamples) holds a NaN feature. Its batch
    holds some record twice, so ``batch["idx"]`` is not all distinct; the report named no
    record. It now gives record 23 at the row the loader put it."""
    bad = 23
    seen = M.oversampling_loader(M.Table(nan=bad))  # (its own generator: the same draws)
    step, ids = next((s, b["idx"]) for s, b in enumerate(seen) if bad in b["idx"].tolist())
    rows = (ids == bad).nonzero().flatten().tolist()
    assert len(set(ids.tolist())) < len(ids)  # (the plant: a record drawn twice)
    ev, rep = fire(tmp_path, M.BatchNet, M.oversampling_loader(M.Table(nan=bad)),
                   lambda m, b: (m(b), b["y"]))
    assert (ev["step"], ev["phase"], ev["tensor"], ev["samples"]) == (
        step, "input", 'batch["x"]', rows), ev
    o = rep["origin"]
    assert (rep["reproduced"], o["phase"], o["samples"], rep["cause"]) == (
        True, "input", rows, "input"), o
    assert o["records"] == {'batch["idx"]': [bad] * len(rows)}, o
    assert any(f'are batch["idx"] = {[bad] * len(rows)}' in p for p in rep["problems"])


def test_an_empty_record_in_the_last_short_batch_is_named_by_the_lengths_given(tmp_path):
    """27 clips in batches of 8 (``drop_last=False``): the last batch holds records 24 to 26.
    Record 25 has no frame; the model's mean divides by its length, 0. The replay names
    ``aten.div`` in ``pool`` at its row, and the hint the lengths argument as 0 there."""
    bad, size = 25, 8
    step, row = divmod(bad, size)
    loader = DataLoader(M.Clips(empty=bad), batch_size=size, collate_fn=M.pad_collate)
    ev, rep = fire(tmp_path, M.ClipNet, loader, lambda m, b: (m(b[0], b[1]), b[2]))
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (
        step, "forward", "pool", [row]), ev
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["samples"], o["batch_size"],
            rep["cause"]) == (True, "pool", "aten.div", [row], 27 - step * size, "invalid"), o
    assert f"Sample(s) {row} are empty records: args[1] (one count per sample: a length) " \
        "is 0" in rep["hint"], rep["hint"]


@pytest.mark.parametrize("plant", ["nan", "zero"])
def test_a_batch_left_as_a_list_of_records_names_the_record_s_place_in_it(tmp_path, plant):
    """27 records in batches of 8, the collate_fn leaving the feature vectors as a list: the
    last batch is records 24 to 26 and record 25 is element 1 of its list. The samples were
    read along each vector's features (a NaN input named no sample: [] of 6, or of a batch
    of 8) and the 3 x 3 logits of the last batch gave no batch size; now a NaN feature is an
    input event at sample 1 of 3, and a feature of 0 the model divides by a forward event of
    ``aten.div`` in ``ratio`` there."""
    bad, size = 25, 8
    step, row = divmod(bad, size)
    loader = DataLoader(M.Table(n=27, **{plant: bad}), batch_size=size,
                        collate_fn=M.list_collate)
    ev, rep = fire(tmp_path, M.ListNet, loader, lambda m, b: (m(b[0]), b[1]))
    o = rep["origin"]
    if plant == "nan":
        assert (ev["step"], ev["phase"], ev["tensor"], ev["samples"]) == (
            step, "input", f"batch[{row}]", [row]), ev
        assert (o["phase"], o["samples"], o["batch_size"], rep["cause"]) == (
            "input", [row], 27 - step * size, "input"), o
    else:
        assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (
            step, "forward", "ratio", [row]), ev
        assert (o["module"], o["op"], o["samples"], o["batch_size"], rep["cause"]) == (
            "ratio", "aten.div", [row], 27 - step * size, "invalid"), o
    assert rep["reproduced"], rep


def test_a_list_of_record_dicts_names_the_record_by_each_dict_s_id(tmp_path):
    """A shuffled loader (seeded generator) handing the model its list of record dicts
    (``collate_fn=list``, a detection loader's targets' shape), each with its ``idx`` and a
    0-d ``image_id``: the ids are one value per dict, no collated column, and no record was
    named. The report now gives record 11 from ``batch[*]["idx"]`` and ``["image_id"]``."""
    bad = 11

    def loader():
        return DataLoader(M.Table(n=27, nan=bad), batch_size=8, shuffle=True,
                          generator=torch.Generator().manual_seed(7), collate_fn=lambda items: [
                              dict(r, image_id=torch.tensor(r["idx"])) for r in items])
    step, row = next((s, [r["idx"] for r in b].index(bad)) for s, b in enumerate(loader())
                     if bad in [r["idx"] for r in b])
    ev, rep = fire(tmp_path, M.RecordsNet, loader(),
                   lambda m, b: (m(b), torch.stack([r["y"] for r in b])))
    assert (ev["step"], ev["phase"], ev["tensor"], ev["samples"]) == (
        step, "input", f'batch[{row}]["x"]', [row]), ev
    o = rep["origin"]
    assert (o["samples"], rep["cause"]) == ([row], "input"), o
    assert o["records"] == {'batch[*]["idx"]': [bad], 'batch[*]["image_id"]': [bad]}, o


def test_split_and_joined_datasets_shuffled_over_workers_train_bit_identically(tmp_path):
    """``random_split`` and ``Subset`` of two ``ConcatDataset`` parts, shuffled by a seeded
    generator across two persistent workers (seeded from it), and the oversampling sampler:
    the recorder draws from no RNG, so the losses equal those without it; no bundle."""
    def loaders():
        parts = ConcatDataset([M.Table(n=13), M.Table(n=14)])
        train_part, _ = random_split(Subset(parts, range(1, 27)), [20, 6],
                                     generator=torch.Generator().manual_seed(3))
        yield DataLoader(train_part, batch_size=8, shuffle=True, num_workers=2,
                         persistent_workers=True, generator=torch.Generator().manual_seed(4))
        yield M.oversampling_loader(M.Table())

    def call(m, b):
        return m(b), b["y"]
    for recorded, plain in zip(loaders(), loaders()):
        assert train(tmp_path, M.BatchNet, recorded, call) == \
            train(None, M.BatchNet, plain, call, record=False)
    assert not list(tmp_path.rglob("*.nan"))
