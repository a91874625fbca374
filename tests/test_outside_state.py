"""State a step reads outside the model's recorded modules: a cache of tensors kept beside the
model (an entry made before the recorder attached, holding NaN) is named where the forward
reads it; a loss updating a running average or a count of its own (a float on itself, on an
object it holds, on a loss module or its submodule) is recorded as the step began and the
step replays, and a bundle holding it only as the event left it names the attribute
(``outside_state_models``)."""

from __future__ import annotations

import contextlib

import outside_state_models as M
import pytest
import torch
from bundles import nanreplay_json, rewrite, source_line

from recorder import FlightRecorder, NonFiniteError
from recorder.attributes import AttributeWatch

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("outside_state_models.py", text)


def batches(steps: int, shift: float = 0.0):
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        yield torch.randn(8, 6, generator=g) + shift, torch.randn(8, 1, generator=g)


def train(make: str, tmp_path, loss_fn=None, steps: int = 3, record: bool = True,
          shift: float = 0.0, targets=None, rewind: int | None = None):
    """SGD on random regression batches (``shift`` added to the inputs, ``targets(step, y)``
    made of the targets), under the recorder when ``record``; the losses, or the event when
    the recorder stopped the run."""
    model = getattr(M, make)()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    rec = FlightRecorder(model, opt, loss_fn=loss_fn or torch.nn.MSELoss(), out_dir=tmp_path,
                         factory=f"outside_state_models:{make}", rewind=rewind) \
        if record else None
    losses = []
    try:
        with rec if rec is not None else contextlib.nullcontext():
            for i, (x, y) in enumerate(batches(steps, shift)):
                y = y if targets is None else targets(i, y)
                out = model(x)
                loss = (rec.loss_fn if rec else loss_fn or torch.nn.MSELoss())(out, y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
    except NonFiniteError as e:
        return e.event
    return losses


@pytest.mark.parametrize("cache", ["dict", "lru"])
def test_a_cached_encoding_filled_with_nan_before_the_recorder_is_named(tmp_path, cache):
    """An evaluation pass before training normalised the cached encoding in place by its first
    entry, 0: 0/0 at position 0, so every row of the first training step is NaN. The replay's
    process builds the cache afresh (finite), so its two re-runs agree with each other and not
    with the recording: the report names the addition that reads the cached tensor, on its
    line in the root, as a tensor kept outside the model, and the hint says to hold it as a
    buffer."""
    make = "make_encoded" if cache == "dict" else "make_encoded_lru"
    cached = M.positions(6) if cache == "dict" else M.ramp(6)
    cached.div_(cached[0].clone())  # (the plant: 0/0 at position 0)
    try:
        event = train(make, tmp_path)
    finally:
        M._PE_CACHE.clear()
        M.ramp.cache_clear()
    assert (event["step"], event["module"], event["samples"]) == (0, "", list(range(8))), event
    (bundle,) = tmp_path.glob("*.nan")
    rep = nanreplay_json(bundle, code=1)
    assert (rep["reproduced"], rep["cause"], rep["diverged"]) == (False, "not_reproduced", None)
    kept = rep["kept_outside"]
    assert (kept["op"], kept["module"], kept["source"], kept["input"], kept["shape"]) == (
        "aten.add", "", line_of("return self.fc(x + pe)"), 1, [6]), kept
    assert "register_buffer" in rep["hint"] and "kept outside the model" in rep["hint"]


def test_a_finite_cache_changes_nothing_the_recorder_sees(tmp_path):
    """The same model with its cache built in the loop: the same losses, bit for bit, with and
    without the recorder, and no event."""
    M._PE_CACHE.clear()
    first = train("make_encoded", tmp_path, record=False)
    M._PE_CACHE.clear()
    assert train("make_encoded", tmp_path) == first and isinstance(first, list)
    assert not list(tmp_path.glob("*.nan"))


EMA_LOSSES = [(M.EmaLoss, "mean", "loss = raw / self.mean"),
              (M.HeldEmaLoss, "stats.mean", "loss = raw / self.stats.mean"),
              (M.EmaLossModule, "mean", "loss = raw / self.mean  # (as a module)")]


def event_bundle(tmp_path, loss_fn):
    event = train("make_linear", tmp_path, loss_fn=loss_fn)
    assert (event["step"], event["phase"]) == (0, "loss"), event
    (bundle,) = tmp_path.glob("*.nan")
    return bundle


@pytest.mark.parametrize("loss, attribute, divides", EMA_LOSSES)
def test_a_loss_updating_its_own_average_replays(tmp_path, loss, attribute, divides):
    """The running mean starts at 0, so the first step divides by 0 (+inf). The loss's call
    updates the mean after the division; the bundle keeps it as the step began (on the loss,
    on a plain object it holds, on a loss module), and every re-run begins there: the division
    is reproduced on its line in the loss, and the hint names the attribute that was 0."""
    rep = nanreplay_json(event_bundle(tmp_path, loss()))
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["op"], o["module"], o["source"]) == (
        True, "invalid", "aten.div", "<loss>", line_of(divides)), rep
    assert f"attribute {attribute} is 0 as the step began" in rep["hint"], rep["hint"]
    assert rep.get("loss_updates") is None


@pytest.mark.parametrize("loss, attribute, divides", EMA_LOSSES)
def test_a_bundle_without_the_loss_as_the_step_began_names_its_update(tmp_path, loss,
                                                                      attribute, divides):
    """A bundle that holds the loss only as the event left it (an older recorder's: no
    ``started``) makes no re-run begin where the run did: the replay says the event is not
    reproduced, names the attribute the loss changes with the value a re-run began with (the
    step's update, 0.1 of the raw loss) and the one one more call left (1.9 times it), and
    says to keep it on the model."""
    def older(meta):
        del meta["loss"]["started"]
        return meta
    bundle = rewrite(event_bundle(tmp_path, loss()), tmp_path / "older" / "old.nan", meta=older)
    rep = nanreplay_json(bundle, code=1)
    assert (rep["reproduced"], rep["cause"]) == (False, "not_reproduced"), rep
    assert list(rep["loss_updates"]) == [attribute], rep["loss_updates"]
    began, left = rep["loss_updates"][attribute]
    assert began > 0 and left == pytest.approx(1.9 * began, rel=1e-6), rep["loss_updates"]
    assert "module of the model" in rep["hint"], rep["hint"]


def test_a_warm_up_counted_over_a_class_default_replays(tmp_path):
    """``calls = 0`` in the class body, ``self.calls += 1`` in forward: the instance's own
    attribute appears at the first call, after the recorder attached. The recorder reads it
    as each step begins all the same (through the instance, the class default until then), so
    the replay sets the count the step began with: the log of the first step past the warm-up
    whose batch has a negative input is reproduced on its line, on those rows, and the
    warm-up's count is named as restored."""
    warmup = M.WarmStart.warmup
    rows = [(x < 0).any(1).nonzero().flatten().tolist() for x, _ in batches(12, shift=2.0)]
    step = next(i for i, r in enumerate(rows) if i >= warmup and r)
    event = train("make_warm_start", tmp_path, steps=12, shift=2.0)
    assert (event["step"], event["samples"]) == (step, rows[step]), event
    (bundle,) = tmp_path.glob("*.nan")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["op"], o["module"], o["samples"], o["source"]) == (
        True, "aten.log", "", rows[step], line_of("return self.fc(torch.log(x))")), rep
    assert f"<root>.calls = {step} (the factory built 0)" in " ".join(rep["problems"])


def test_reading_a_class_default_each_step_changes_nothing(tmp_path):
    """The warm-up model through its warm-up, with and without the recorder: the same losses,
    bit for bit, and the instance's count the same."""
    first = train("make_warm_start", tmp_path, record=False, shift=2.0)
    assert train("make_warm_start", tmp_path, shift=2.0) == first and len(first) == 3


def positive(step: int, y: torch.Tensor, planted: dict | None = None) -> torch.Tensor:
    """Targets above 0, but for the ``planted`` rows of a step (``{step: rows}``): -1."""
    y = y.abs() + 0.5
    if planted and step in planted:
        y[planted[step]] = -1.0
    return y


def test_a_warm_up_counted_by_the_loss_s_own_submodule_replays(tmp_path):
    """A loss module takes the log of its targets during a warm-up that its submodule counts
    at each call (``<loss>.schedule``), then MSE. Two rows of the warm-up's last step are
    planted below 0: the log there is NaN on those rows. The count is recorded as that step
    began (one short of the warm-up's end), so the re-run takes the same branch: the log is
    reproduced on its line in the loss, on the planted rows, out of its domain."""
    warmup, rows = 3, [2, 5]
    step = warmup - 1  # (the last call counted inside the warm-up)
    event = train("make_linear", tmp_path, loss_fn=M.WarmLogLoss(warmup), steps=warmup + 1,
                  targets=lambda i, y: positive(i, y, {step: rows}))
    assert (event["step"], event["phase"]) == (step, "loss"), event
    (bundle,) = tmp_path.glob("*.nan")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["op"], o["module"], o["samples"], o["source"]) \
        == (True, "invalid", "aten.log", "<loss>", rows,
            line_of("return ((out - torch.log(y)) ** 2).mean()")), rep


def test_a_rewind_window_begins_each_step_with_the_loss_s_own_count(tmp_path):
    """The other way round: MSE during the warm-up, then the log of the targets. Rows are
    planted below 0 in the first step, inside the warm-up (finite), and in the first step past
    it (the event). The rewind window re-runs every step from the first, each from the count
    it began with (the bundle's records), so its first non-finite value is the event step's
    loss, not the first step's."""
    warmup, planted = 3, {0: [1], 3: [2, 5]}
    event = train("make_linear", tmp_path, loss_fn=M.WarmLogLoss(warmup, log_after=True),
                  steps=warmup + 1, targets=lambda i, y: positive(i, y, planted),
                  rewind=warmup + 1)
    assert (event["step"], event["phase"]) == (warmup, "loss"), event
    (bundle,) = tmp_path.glob("*.nan")
    rep = nanreplay_json(bundle)
    o, w = rep["origin"], rep["window"]
    assert (rep["reproduced"], o["op"], o["samples"]) == (True, "aten.log", planted[warmup]), rep
    assert (w["reproduced"], w["steps"], w["first_non_finite"]["step"],
            w["first_non_finite"]["phase"]) == (True, [0, warmup], warmup, "loss"), w


def test_a_loss_keeping_its_own_count_changes_nothing_the_recorder_sees(tmp_path):
    """The warm-up loss through and past its warm-up, with and without the recorder: the same
    losses, bit for bit, no event, and the loss's count the same."""
    runs = []
    for record in (False, True):
        loss = M.WarmLogLoss(3)
        runs.append((train("make_linear", tmp_path, loss_fn=loss, steps=5, record=record,
                           targets=positive), loss.schedule.calls))
    assert runs[0] == runs[1] and runs[0][1] == 5 and len(runs[0][0]) == 5, runs
    assert not list(tmp_path.glob("*.nan"))


def test_torch_s_own_losses_are_not_watched():
    """A loss of torch's own classes changes no attribute in its forward: nothing of it is read
    as each step begins. A user's loss is, its held objects and submodules by name."""
    assert AttributeWatch((), torch.nn.CrossEntropyLoss(label_smoothing=0.1)).at_attach == {}
    assert AttributeWatch((), M.HeldEmaLoss()).at_attach == {"<loss>": {},
                                                            "<loss>.stats": {"mean": 0.0}}
    assert AttributeWatch((), M.WarmLogLoss(3)).at_attach == {
        "<loss>": {"log_after": False}, "<loss>.schedule": {"warmup": 3, "calls": 0}}


def test_a_loss_attribute_the_loop_sets_after_the_forward_keeps_its_value(tmp_path):
    """The loop sets the loss's divisor to 0 after the step's forward, just before the loss
    call (the step began with it 1): the call computed with 0, which the loss's call does not
    change, so the replay keeps the value the event left (not the step-start one) and the
    division by it is reproduced on its line in the loss, the attribute named."""
    loss, bad = M.ScaledLoss(), 2
    model = M.make_linear()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=loss, out_dir=tmp_path,
                            factory="outside_state_models:make_linear") as rec:
            for i, (x, y) in enumerate(batches(4)):
                out = model(x)
                loss.scale = 0.0 if i == bad else 1.0  # (the plant: set after the forward)
                opt.zero_grad()
                rec.loss_fn(out, y).backward()
                opt.step()
    assert (info.value.event["step"], info.value.event["phase"]) == (bad, "loss")
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], o["op"], o["module"], o["source"]) == (
        True, "aten.div", "<loss>", line_of("return ((out - y) ** 2).mean() / self.scale")), rep
    assert "attribute scale is 0 as the step closed" in rep["hint"], rep["hint"]
