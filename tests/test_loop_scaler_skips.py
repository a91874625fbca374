"""End to end: a dynamic loss scaler written in the loop (fairseq's ``DynamicLossScaler``,
Megatron's and apex's follow the same pattern) skips the update of a step whose scaled
gradients overflowed. ``rec.end_step(skipped=True)`` tells the recorder so: the step closes as
a GradScaler-skipped one does, marked skipped, its gradients unchecked; too many skips in a
row are an event. Without it, each routine overflow was a backward event."""

from __future__ import annotations

import low_precision_models as M
import pytest
import torch
import torch.nn.functional as F
from bundles import nanreplay_json

from recorder import FlightRecorder, NonFiniteError
from recorder.bundle import read_bundle

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def train(out_dir, steps: int, init_scale: float, skipped: bool | None = True,
          nan_at: int | None = None, **kw):
    """SGD with momentum, the loss scaled by hand from ``init_scale`` (past float32's range:
    the first steps overflow and halve it, as fp16 runs do at their start); on overflow the
    loop drops the gradients and skips ``step()``. ``skipped`` None: no recorder."""
    model = M.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    scaler = M.DynamicLossScaler(init_scale=init_scale, scale_window=2, max_scale=2.0 ** 100)
    g = torch.Generator().manual_seed(0)
    skips = []
    rec = None if skipped is None else FlightRecorder(
        model, opt, loss_fn=F.cross_entropy, out_dir=out_dir,
        factory="low_precision_models:make_mlp", **kw).attach()
    try:
        for s in range(steps):
            x = torch.randn(8, M.D_IN, generator=g)
            y = x[:, :M.N_CLASSES].argmax(1)
            if s == nan_at:
                x[5, 1] = float("nan")
            loss = (rec.loss_fn if rec else F.cross_entropy)(model(x), y)
            opt.zero_grad()
            (loss * scaler.loss_scale).backward()
            overflow = not all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
            if overflow:
                skips.append(s)
                if rec is not None:
                    rec.end_step(skipped=skipped)
                opt.zero_grad()
            else:
                for p in model.parameters():
                    p.grad.div_(scaler.loss_scale)
                opt.step()
            scaler.update(overflow)
        if rec is not None:
            rec.end_step()
    finally:
        if rec is not None:
            rec.detach()
    return model, skips


def test_overflow_skips_of_a_hand_written_scaler_are_not_events(out_dir):
    model, skips = train(out_dir / "rec", 10, 2.0 ** 130)
    bare, bare_skips = train(out_dir / "bare", 10, 2.0 ** 130, skipped=None)
    assert skips == bare_skips and skips[:3] == [0, 1, 2] and len(skips) < 10, skips
    assert not list(out_dir.rglob("*.nan"))
    for (n, p), q in zip(model.named_parameters(), bare.parameters()):
        assert torch.equal(p, q), n
    # (was, and still is for a plain end_step(): the first overflow is a backward event)
    with pytest.raises(NonFiniteError) as info:
        train(out_dir / "plain", 10, 2.0 ** 130, skipped=False)
    assert (info.value.event["step"], info.value.event["phase"]) == (0, "backward")


def test_a_later_event_replays_its_window_with_the_loops_skips(out_dir):
    _, skips = train(out_dir / "bare", 9, 2.0 ** 130, skipped=None)
    with pytest.raises(NonFiniteError) as info:
        train(out_dir, 9, 2.0 ** 130, nan_at=7, rewind=8)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["tensor"], ev["samples"]) == (7, "input", "batch", [5])
    _, t = read_bundle(info.value.bundle_path)
    assert t["ring/steps"].tolist() == list(range(8))
    assert [s for s in range(7) if t["ring/skipped"][s]] == [s for s in skips if s < 7]
    rep = nanreplay_json(info.value.bundle_path)
    assert (rep["reproduced"], rep["cause"], rep["origin"]["samples"]) == (True, "input", [5])
    w = rep["window"]
    # (was: the re-run updated with the overflowed gradients the loop had dropped, and its
    # first non-finite value came at step 0)
    assert (w["steps"], w["reproduced"], w["event_step"]) == ([0, 7], True, 7), w
    assert [s["step"] for s in w["per_step"] if s["skipped"]] == [s for s in skips if s < 7]
    # the loop divides its gradients by the scale it put on the loss: the re-run does too
    # (was: read as gradient clipping to the recorded norm, and the scaled norms, 1e37, made
    # a "gradient norm began" precursor at the first update)
    assert (w["loop_unscale"], w["loop_clip"], w["precursors_began"]) == (True, None, None), w
    norms = [s["grad_norm"] for s in w["per_step"] if not s["skipped"] and s["step"] < 7]
    assert norms and all(0 < n < 10 for n in norms), norms


def test_a_scaler_that_never_recovers_is_a_skipping_event(out_dir):
    # halving an infinite scale keeps it infinite: every step overflows and is skipped
    with pytest.raises(NonFiniteError) as info:
        train(out_dir, 8, float("inf"), max_skipped_steps=3)
    ev = info.value.event
    assert (ev["step"], ev["reason"], ev["phase"], ev["kind"]) == (
        3, "scale_skipping", "backward", "scale"), ev
    assert "loop's own loss scaler" in ev["detail"], ev["detail"]
    rep = nanreplay_json(info.value.bundle_path)
    assert (rep["reproduced"], rep["cause"]) == (True, "overflow"), rep
    assert "infinite factor" in rep["hint"] and "Cap the scale" in rep["hint"], rep["hint"]
