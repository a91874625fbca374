"""Batches from a Hugging Face ``datasets.Dataset`` built in memory, as fine-tuning scripts
write them: ``DataCollatorWithPadding``'s ``BatchEncoding`` given to the model whole or unpacked
(``model(**batch)``) after the loop pops the labels and the ``idx``, and a hand collate carrying
WebDataset-style string keys and a Python int beside the tensors. The report names the batch's
row, and the dataset record where the batch given to the model carries its id; ``drop=`` removes
that row from the ``BatchEncoding``; the healthy loops train bit-identically."""

from __future__ import annotations

import contextlib

import hf_dataset_batches_models as M
import pytest
import torch

import replay
from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def where(loader, record: int, key: str) -> tuple[int, int]:
    """(step, row) at which the shuffled ``loader`` yields ``record`` (``batch[key]``)."""
    for step, batch in enumerate(loader):
        ids = [str(v) for v in (batch[key].tolist() if torch.is_tensor(batch[key])
                                else batch[key])]
        if str(record) in ids:
            return step, ids.index(str(record))
    raise AssertionError(f"record {record} never loaded")


def train(out_dir, loader, make: str, call, target: str, record: bool = True) -> list[float]:
    """AdamW and cross-entropy over ``loader``; ``call(model, batch)`` runs the forward."""
    model = getattr(M, make)()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    crit = torch.nn.CrossEntropyLoss()
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"hf_dataset_batches_models:{make}") if record else None
    losses = []
    with rec if rec is not None else contextlib.nullcontext():
        for batch in loader:
            opt.zero_grad()
            labels = batch[target]
            loss = crit(call(model, batch), labels)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses


def unpacked(model, batch):
    """The metadata popped off the ``BatchEncoding`` before ``model(**batch)``."""
    batch.pop("labels"), batch.pop("idx")
    return model(**batch)


def test_popped_metadata_and_model_kwargs_train_bit_identically(tmp_path):
    """No event, no bundle, and the losses equal those of the loop without the recorder."""
    for make, call in (("make_bag", unpacked), ("make_whole_bag", lambda m, b: m(b))):
        assert train(tmp_path, M.padded_loader(M.texts()), make, call, "labels") == \
            train(None, M.padded_loader(M.texts()), make, call, "labels", record=False)
    assert train(tmp_path, M.keyed_loader(M.features()), "make_tabular", lambda m, b: m(b),
                 "y") == train(None, M.keyed_loader(M.features()), "make_tabular",
                               lambda m, b: m(b), "y", record=False)
    assert not list(tmp_path.rglob("*.nan"))


def test_an_empty_text_in_a_batch_encoding_names_its_row_its_idx_and_drops(tmp_path):
    """Record 13's text is empty: its attention mask has no 1, the masked mean is 0/0. The
    collator's ``BatchEncoding`` (no dict) goes to the model whole: the report names the row
    the shuffle put it at and, from ``batch["idx"]``, record 13 (missed before: the replay read
    record ids from dicts and dataclasses only); dropping that row leaves the step finite."""
    bad = 13
    step, row = where(M.padded_loader(M.texts(bad)), bad, "idx")
    with pytest.raises(NonFiniteError) as info:
        train(tmp_path, M.padded_loader(M.texts(bad)), "make_whole_bag", lambda m, b: m(b),
              "labels")
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (
        step, "forward", "bag", [row]), ev
    other = (row + 1) % M.BATCH
    rep = replay.replay(info.value.bundle_path, tries=[f"drop={row}", f"drop={other}"])
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["samples"], rep["cause"]) == (
        True, "bag", "aten.div", [row], "invalid"), (o, rep["cause"])
    assert o["records"] == {'batch["idx"]': [bad]}, o
    dropped, kept = rep["what_if"]
    assert (dropped["finite"], kept["finite"], kept["inconclusive"]) == (True, False, False), \
        rep["what_if"]


def test_an_inf_feature_names_the_record_by_its_key_and_numpy_ids(tmp_path):
    """Record 21 holds an inf feature; the collated dict carries each record's ``__key__`` (a
    string, WebDataset's name for a sample; a bare ``key`` was taken for an attention's
    before), its row as a NumPy array (stored as its ``repr`` before: the replay stopped,
    'cannot be rebuilt') and as a list of NumPy integers (not taken for ids before), and a
    Python int: the input event names the row, the report the record's ids, and dropping the
    row (from the array too) leaves the step finite."""
    bad = 21
    step, row = where(M.keyed_loader(M.features(bad)), f"shard-0/{bad:05d}", "__key__")
    with pytest.raises(NonFiniteError) as info:
        train(tmp_path, M.keyed_loader(M.features(bad)), "make_tabular", lambda m, b: m(b), "y")
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["tensor"], ev["samples"]) == (
        step, "input", 'batch["x"]', [row]), ev
    rep = replay.replay(info.value.bundle_path, tries=[f"drop={row}"])
    o = rep["origin"]
    assert (o["phase"], o["samples"], rep["cause"]) == ("input", [row], "input"), o
    assert o["records"] == {'batch["__key__"]': [f"shard-0/{bad:05d}"],
                            'batch["row_id"]': [bad], 'batch["example_id"]': [bad]}, o
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]
