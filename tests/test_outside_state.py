"""State a step reads that the bundle does not hold as the step found it: a cache of tensors
kept beside the model (an entry made before the recorder attached, holding NaN) is named
where the forward reads it; a loss updating a running average of its own (a float on itself,
on an object it holds, or on a loss module) is named with the attribute, since the bundle
records a loss as the event left it (``outside_state_models``)."""

from __future__ import annotations

import contextlib

import outside_state_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("outside_state_models.py", text)


def batches(steps: int, shift: float = 0.0):
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        yield torch.randn(8, 6, generator=g) + shift, torch.randn(8, 1, generator=g)


def train(make: str, tmp_path, loss_fn=None, steps: int = 3, record: bool = True,
          shift: float = 0.0):
    """SGD on random regression batches (``shift`` added to the inputs), under the recorder
    when ``record``; the losses, or the event when the recorder stopped the run."""
    model = getattr(M, make)()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    rec = FlightRecorder(model, opt, loss_fn=loss_fn or torch.nn.MSELoss(), out_dir=tmp_path,
                         factory=f"outside_state_models:{make}") if record else None
    losses = []
    try:
        with rec if rec is not None else contextlib.nullcontext():
            for x, y in batches(steps, shift):
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


@pytest.mark.parametrize("loss, attribute", [(M.EmaLoss, "mean"),
                                             (M.HeldEmaLoss, "stats.mean")])
def test_a_plain_loss_updating_its_own_average_is_named(tmp_path, loss, attribute):
    """The running mean starts at 0, so the first step divides by 0 (+inf in every row). The
    bundle holds the loss as the event left it, the mean already updated; the replay's loss
    object updates it again at each re-run, so the two re-runs divide by different floats: the
    division is named on its line in the loss, its Python argument the one that differed, and
    the report names the attribute the loss changes and says to keep it on the model."""
    event = train("make_linear", tmp_path, loss_fn=loss())
    assert (event["step"], event["phase"]) == (0, "loss"), event
    (bundle,) = tmp_path.glob("*.nan")
    rep = nanreplay_json(bundle, code=1)
    assert (rep["reproduced"], rep["cause"]) == (False, "not_reproduced")
    d = rep["diverged"]
    divides = "loss = raw / self.mean" if attribute == "mean" else \
        "loss = raw / self.stats.mean"
    assert (d["op"], d["why"], d["module"], d["source"]) == (
        "aten.div", "arguments", None, line_of(divides)), d
    assert list(rep["loss_updates"]) == [attribute], rep["loss_updates"]
    assert f"({attribute}:" in rep["hint"] and "module of the model" in rep["hint"]


def test_a_loss_module_updating_its_own_average_is_named(tmp_path):
    """The same running mean on a loss module, which the replay sets back before each re-run:
    the re-runs agree (nothing diverged) but start from the mean after the step's update, so
    the event does not come back; the report names the attribute, not "state outside"."""
    event = train("make_linear", tmp_path, loss_fn=M.EmaLossModule())
    assert (event["step"], event["phase"]) == (0, "loss"), event
    (bundle,) = tmp_path.glob("*.nan")
    rep = nanreplay_json(bundle, code=1)
    assert (rep["reproduced"], rep["cause"], rep["diverged"]) == (False, "not_reproduced", None)
    # (the bundle's mean is the step's update, 0.1 * raw; one more call of the same step adds
    # 0.1 * raw again to 0.9 of it: 1.9 times, where the run began from 0)
    began, left = rep["loss_updates"]["mean"]
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
