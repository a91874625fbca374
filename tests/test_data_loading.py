"""End to end on input pipelines as users write them (``data_loading_models``): DataLoaders with
two persistent workers seeded by ``worker_init_fn``; dict records padded by a collate_fn and
batched by length buckets (batches of varying size), by a ``WeightedRandomSampler`` or in order
with a last short batch; namedtuple image records randomly cropped in the workers, standardised
there or in the model, mixed up in the loop with a Beta draw; an ``IterableDataset`` sharded by
``get_worker_info`` collated into a dataclass, under float16 autocast. Each corrupt record the
domain meets fires under the recorder and is replayed with the CLI; the report names the
batch's rows, and the dataset's records where the batch carries their ids; the healthy runs
raise no event and train bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import data_loading_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("data_loading_models.py", text)


def where(loader, record: int, ids) -> tuple[int, int]:
    """(step, row) at which ``loader`` yields ``record`` (``ids(batch)``: its record ids)."""
    for step, batch in enumerate(loader):
        hits = (ids(batch) == record).nonzero().flatten().tolist()
        if hits:
            return step, hits[0]
    raise AssertionError(f"record {record} never loaded")


def train_seq(out_dir, data, loader=M.bucket_loader, record=True, whole=False):
    """The sequence classifier over ``loader(data)``: Adam, gradient norm clipped at 1, the
    sample-weighted cross-entropy given the batch's labels and weights. ``whole``: the model
    is given the collated dict whole (with the record ids beside the features)."""
    make = "make_batch_seq" if whole else "make_seq"
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    criterion = M.WeightedCE()
    rec = FlightRecorder(model, opt, loss_fn=criterion, out_dir=out_dir,
                         factory=f"data_loading_models:{make}") if record else None
    torch.manual_seed(0)
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else criterion
        for b in loader(data):
            opt.zero_grad()
            out = model(b) if whole else model(b["x"], b["mask"])
            loss_fn(out, b["label"], b["weight"]).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    return model


def train_images(out_dir, data, make="make_cnn", mix=False, record=True, perms=None,
                 amp=None):
    """The CNN over the images in order (8 a batch): SGD with momentum, cross-entropy, or,
    ``mix``, mixup in the loop and the soft-target cross-entropy (``perms`` gets each step's
    mixing permutation); ``amp``: the forward under CPU autocast to that type."""
    model = getattr(M, make)()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    criterion = M.soft_cross_entropy if mix else torch.nn.CrossEntropyLoss()
    rec = FlightRecorder(model, opt, loss_fn=criterion, out_dir=out_dir,
                         factory=f"data_loading_models:{make}") if record else None
    torch.manual_seed(0)
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else criterion
        for x, y, _ in M.image_loader(data):
            target = y
            if mix:
                x, target, perm = M.mixup(x, y)
                (perms if perms is not None else []).append(perm)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
                out = model(x)
            loss_fn(out.float(), target).backward()
            opt.step()
    return model


def train_stream(out_dir, data, record=True):
    """The MLP over the sharded stream's raw columns, its forward under float16 autocast, the
    loss given the dataclass batch whole; AdamW."""
    model = M.make_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    criterion = M.RowsMSE()
    rec = FlightRecorder(model, opt, loss_fn=criterion, out_dir=out_dir,
                         factory="data_loading_models:make_mlp") if record else None
    torch.manual_seed(0)
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else criterion
        for b in M.stream_loader(data):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                pred = model(b.features)
            loss_fn(pred, b).backward()
            opt.step()
    return model


def fire(train, tmp_path, *args, **kw):
    with pytest.raises(NonFiniteError) as info:
        train(tmp_path, *args, **kw)
    return info.value.event, info.value.bundle_path


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name


def test_healthy_pipelines_raise_nothing_and_train_bit_identically(tmp_path):
    """Bucketed, weighted and in-order sequence loaders, images with mixup, the sharded stream
    under autocast, all with two persistent workers: no event, no bundle, and the weights equal
    those of the same loop without the recorder (its hooks draw nothing from the RNG the
    loader's worker seeds and the mixup's Beta come from)."""
    for loader in (M.bucket_loader, M.weighted_loader, M.ordered_loader):
        same_weights(train_seq(tmp_path / loader.__name__, M.Records(), loader),
                     train_seq(None, M.Records(), loader, record=False))
    same_weights(train_images(tmp_path / "img", M.Images(), mix=True),
                 train_images(None, M.Images(), mix=True, record=False))
    same_weights(train_stream(tmp_path / "rows", M.CsvStream()),
                 train_stream(None, M.CsvStream(), record=False))
    assert not list(tmp_path.rglob("*.nan"))


def test_a_nan_feature_names_the_row_and_the_record_id_the_batch_carries(tmp_path):
    """Record 17 holds a feature its parser read as NaN. The bucketing sampler puts it at some
    row of some step; the model is given the collated dict whole, so the input event names
    ``batch["x"]`` at that row and the report gives the record id, 17, from ``batch["id"]``,
    and the file it was read from, from the collated list of strings ``batch["path"]``."""
    data = M.Records(corrupt={17: "nan"})
    step, row = where(M.bucket_loader(data, workers=0), 17, lambda b: b["id"])
    ev, bundle = fire(train_seq, tmp_path, data, whole=True)
    assert (ev["step"], ev["phase"], ev["tensor"], ev["samples"]) == (
        step, "input", 'batch["x"]', [row]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["phase"], o["tensor"], o["samples"], rep["cause"]) == (
        True, "input", 'batch["x"]', [row], "input"), o
    assert o["records"] == {'batch["id"]': [17], 'batch["path"]': ["shard-1/rec-0017.pt"]}, o
    assert any('are batch["id"] = [17]; batch["path"] = ["shard-1/rec-0017.pt"]' in p
               for p in rep["problems"]), rep["problems"]


def test_an_empty_sequence_names_the_masked_mean_and_the_empty_record(tmp_path):
    """Record 23 has no step (an empty transcript): its mask row is all 0 and the masked mean
    divides 0 by 0. The replay names ``aten.div`` in ``pool`` at its row, the count of 0/1
    entries, and the record as empty."""
    data = M.Records(corrupt={23: "empty"})
    step, row = where(M.bucket_loader(data, workers=0), 23, lambda b: b["id"])
    ev, bundle = fire(train_seq, tmp_path, data)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (
        step, "forward", "pool", [row]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == (
        "pool", "aten.div", "nan", [row], "invalid"), o
    assert o["source"] == line_of("mask.sum(1, keepdim=True)  # 0/0: no step"), o
    assert f"Sample(s) {row} are empty records: args[1] (0/1 data)" in rep["hint"], rep["hint"]
    assert "records" not in o  # (the model was given no ids)


def test_a_last_short_batch_of_zero_weight_records_names_the_weighted_mean(tmp_path):
    """44 records, the last 4 carrying sample weight 0 (excluded from the loss); with
    ``drop_last=False`` the last batch is those 4 alone, and the weighted mean divides by a
    weight sum of 0. The replay names the loss's ``aten.div`` of a 0-d divisor, no sample;
    the hint named no data (a generic 'no row is to blame'): it now names the loss's
    ``weight`` argument, 0 in every one of the batch's 4 samples."""
    data = M.Records(n=44, corrupt={i: "zero_weight" for i in range(40, 44)})
    ev, bundle = fire(train_seq, tmp_path, data, M.ordered_loader)
    assert (ev["step"], ev["phase"], ev["module"]) == (5, "loss", "<loss>"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"], o["batch_size"], rep["cause"]) == (
        "<loss>", "aten.div", "nan", [], 4, "invalid"), o
    assert o["source"] == line_of("return (per * weight).sum() / weight.sum()"), o
    assert "skip such batches" in rep["hint"], rep["hint"]
    assert "Here loss_args[2] (weight), which the loss's line reads, is 0 in every one of " \
        "the batch's 4 samples" in rep["hint"], rep["hint"]


def test_a_constant_image_standardised_in_the_worker_is_the_batch_s_input(tmp_path):
    """A blank frame (every pixel 128) divided by its own std of 0 in ``__getitem__`` (run by
    a worker): the batch arrives with NaN in its row. The replay says the input holds it, at
    row 5 of step 1 (record 13 of batches of 8), cause ``input``."""
    data = M.Images(corrupt={13: "constant"}, standardise=True)
    ev, bundle = fire(train_images, tmp_path, data, make="make_plain_cnn")
    assert (ev["step"], ev["phase"], ev["tensor"], ev["samples"]) == (1, "input", "batch", [5])
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["phase"], o["samples"], rep["cause"]) == (
        True, "input", [5], "input"), o
    assert "check the data pipeline for these samples" in rep["hint"], rep["hint"]


def test_a_constant_image_standardised_in_the_model_is_a_backward_sqrt_pole(tmp_path):
    """The same blank frame standardised per channel by the model, ``sqrt`` of the variance
    with the eps outside the root: the forward is finite (0 / eps), the backward of ``sqrt`` at
    0 is not. The replay names ``SqrtBackward0`` in ``norm`` on row 5."""
    data = M.Images(corrupt={13: "constant"})
    ev, bundle = fire(train_images, tmp_path, data)
    assert (ev["step"], ev["phase"]) == (1, "backward"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["phase"], o["module"], o["op"], o["samples"], rep["cause"]) == (
        True, "backward", "norm", "SqrtBackward0", [5], "invalid"), o
    assert o["source"] == line_of("std = ((flat - mean) ** 2).mean(2, keepdim=True).sqrt()"), o
    assert "sqrt(var + eps)" in rep["hint"], rep["hint"]


def test_a_near_constant_image_under_bfloat16_is_a_precision_loss_not_a_mask(tmp_path):
    """A saturated frame (128 plus sensor noise of 1e-3) is no constant image in float32, but
    bfloat16 autocast's convolution rounds it to one: the instance std's root is at 0 and its
    backward is NaN. The replay names ``SqrtBackward0`` in ``norm`` on row 5 as ``precision``
    (finite in float64). Its gradient entering the root is 0 there because the deviations the
    std divides are 0: the hint said a mask dropped the op's output (there is none) and never
    that the root is a std written out; it now says the latter, with the eps under the root."""
    data = M.Images(corrupt={13: "flat"})
    train_images(None, data, record=False)  # (finite in float32: its noise is a variance)
    ev, bundle = fire(train_images, tmp_path, data, amp=torch.bfloat16)
    assert (ev["step"], ev["phase"]) == (1, "backward"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"], o["dtype"], rep["cause"]) == (
        "norm", "SqrtBackward0", [5], "bfloat16", "precision"), o
    assert o["source"] == line_of("std = ((flat - mean) ** 2).mean(2, keepdim=True).sqrt()"), o
    assert "sum of squared deviations from the values' own mean" in rep["hint"], rep["hint"]
    assert "sqrt(var + eps)" in rep["hint"], rep["hint"]
    assert "forward dropped the op's output" not in rep["hint"], rep["hint"]


def test_mixup_spreads_a_nan_record_to_its_partner_row(tmp_path):
    """Record 13 (row 5 of step 1) holds a NaN pixel; mixup in the loop mixes it into the
    row whose shuffled partner it is. The input event names both rows, as the model saw them."""
    data, perms = M.Images(corrupt={13: "nan"}), []
    ev, bundle = fire(train_images, tmp_path, data, make="make_plain_cnn", mix=True,
                      perms=perms)
    rows = sorted({5, perms[1].tolist().index(5)})
    assert len(rows) == 2
    assert (ev["step"], ev["phase"], ev["samples"]) == (1, "input", rows), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["phase"], o["samples"], rep["cause"]) == (
        True, "input", rows, "input"), o


def test_a_value_in_the_wrong_unit_overflows_float16_and_names_its_record(tmp_path):
    """Record 21 of the stream holds a price in cents (9e4) where the others are below 300:
    float16 autocast's cast of ``fc1``'s input overflows. The replay names the cast in
    ``fc1``, its row, the overflow of data out of scale, and record 21 from the dataclass
    batch the loss was given (``row_id``)."""
    data = M.CsvStream(bad={21: 9e4})
    step, row = where(M.stream_loader(data), 21, lambda b: b.row_id)
    ev, bundle = fire(train_stream, tmp_path, data)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (
        step, "forward", "fc1", [row]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == (
        "fc1", "aten._to_copy", "+inf", [row], "overflow"), o
    assert "out of scale" in rep["hint"], rep["hint"]
    assert o["records"] == {"loss_args[1].row_id": [21]}, o


def test_a_nan_target_in_the_dataclass_batch_names_its_record(tmp_path):
    """Record 30's regression target is NaN; the loss is given the dataclass batch whole. The
    input event names ``loss_args[1].target`` at the record's row, and the report gives
    ``row_id`` 30 from the same batch."""
    data = M.CsvStream()
    data.y[30] = float("nan")
    step, row = where(M.stream_loader(data), 30, lambda b: b.row_id)
    ev, bundle = fire(train_stream, tmp_path, data)
    assert (ev["step"], ev["phase"], ev["tensor"], ev["samples"]) == (
        step, "input", "loss_args[1].target", [row]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["tensor"], o["samples"], rep["cause"]) == (
        "input", "loss_args[1].target", [row], "input"), o
    assert o["records"] == {"loss_args[1].row_id": [30]}, o


@pytest.mark.filterwarnings("ignore:std... degrees of freedom:UserWarning")  # (torch's, once)
def test_a_last_batch_of_one_row_names_the_batch_std(tmp_path):
    """65 rows over two workers: one worker's last batch holds a single row, whose std over
    the batch (correction 1) divides by n - 1 = 0. The replay names ``aten.std`` in
    ``scale`` and the batch of one."""
    data = M.CsvStream(n=65)
    model = M.make_batch_standardised()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=M.RowsMSE(), out_dir=tmp_path,
                            factory="data_loading_models:make_batch_standardised") as rec:
            for b in M.stream_loader(data):
                opt.zero_grad()
                rec.loss_fn(model(b.features), b).backward()
                opt.step()
    ev, bundle = info.value.event, info.value.bundle_path
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (8, "forward", "scale", [0])
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"], o["batch_size"], rep["cause"]) == (
        "scale", "aten.std", [0], 1, "invalid"), o
    assert o["source"] == line_of("return (x - x.mean(0)) / (x.std(0) + 1e-6)"), o
    assert "a batch of 1" in rep["hint"], rep["hint"]


def test_class_weights_of_a_class_absent_from_the_dataset_are_named_as_the_loss_s(tmp_path):
    """Inverse-frequency class weights over a training set with no image of class 2:
    ``1 / 0`` is inf, normalised by the sum it is NaN. The loss event is named in
    ``aten.nll_loss_forward``, the loss's ``weight`` non-finite before the step."""
    data = M.Images()
    data.labels[data.labels == 2] = 1
    model = M.make_plain_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    criterion = torch.nn.CrossEntropyLoss(weight=M.class_weights(data.labels))
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=criterion, out_dir=tmp_path,
                            factory="data_loading_models:make_plain_cnn") as rec:
            for x, y, _ in M.image_loader(data):
                opt.zero_grad()
                rec.loss_fn(model(x), y).backward()
                opt.step()
    ev, bundle = info.value.event, info.value.bundle_path
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "loss", "<loss>"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == (
        "<loss>", "aten.nll_loss_forward", [], "weights"), o
    assert "class weights 1/count with a class absent" in rep["hint"], rep["hint"]


def test_an_utterance_of_one_frame_names_the_unbiased_variance_of_its_cmvn(tmp_path):
    """Record 11 is an utterance of a single frame; per-utterance mean and variance
    normalisation divides its squared deviations (0) by the count less one (0). The replay
    names that ``aten.div`` in ``cmvn`` at the record's row, a record of a single step, and
    the variance's n - 1 as the 0 (not only a next-step target's count)."""
    data = M.Records(corrupt={11: "one_step"})
    step, row = where(M.bucket_loader(data, workers=0), 11, lambda b: b["id"])
    model = M.make_cmvn()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=M.WeightedCE(), out_dir=tmp_path,
                            factory="data_loading_models:make_cmvn") as rec:
            for b in M.bucket_loader(data):
                opt.zero_grad()
                rec.loss_fn(model(b["x"], b["mask"]), b["label"], b["weight"]).backward()
                opt.step()
    ev, bundle = info.value.event, info.value.bundle_path
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (
        step, "forward", "cmvn", [row]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == (
        "cmvn", "aten.div", [row], "invalid"), o
    assert o["source"] == line_of("var = (((x - mean) * m) ** 2).sum(1, keepdim=True) / (n - 1)")
    assert f"Sample(s) {row} are records of a single step" in rep["hint"], rep["hint"]
    assert "an unbiased variance's n - 1" in rep["hint"], rep["hint"]


def test_a_corrupt_target_steps_before_the_overflow_is_named_in_the_window(tmp_path):
    """Record 30's target is 1e17 (a corrupt value): its step's loss is finite but enormous,
    plain SGD's update blows the weights up, and the loss overflows on clean batches later.
    With ``rewind=8`` the replay names the loss's overflow, says the trouble began at the
    record's step, and its note names that step's out-of-scale target row and ``row_id`` 30
    (the hint said only "fix what happened there (a bad batch, ...)")."""
    data = M.CsvStream()
    data.y[30] = 1e17
    step, row = where(M.stream_loader(data), 30, lambda b: b.row_id)
    model = M.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=M.RowsMSE(), out_dir=tmp_path, rewind=8,
                            factory="data_loading_models:make_mlp") as rec:
            for b in M.stream_loader(data):
                opt.zero_grad()
                rec.loss_fn(model(b.features), b).backward()
                opt.step()
    ev, bundle = info.value.event, info.value.bundle_path
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (7, "loss", "<loss>", "+inf")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], rep["cause"]) == ("<loss>", "aten.mse_loss", "overflow"), o
    assert rep["window"]["precursors_began"]["step"] == step, rep["window"]
    assert "fix what happened there (a bad batch" in rep["hint"], rep["hint"]
    note = next(p for p in rep["problems"] if "fed rows out of scale" in p)
    assert note.startswith(f"step {step}, where the rewind window shows the trouble began, "
                           f"fed rows out of scale: loss_args[1].target rows [{row}] reach "
                           "1e+17"), note
    assert "(the records: loss_args[1].row_id = [30])" in note, note
