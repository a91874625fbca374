"""Replaying a GradScaler event (reason ``scale_collapse`` or ``scale_skipping``, kind
``scale``): float16 autocast with a scale so large that the scaled gradients overflow, so the
scaler skips every update and halves the scale until the recorder calls it an event.

The unscaled step is finite; what overflowed is its backward with the loss scaled. The replay
re-runs the backward with the scale that step's backward used (read from the ring buffer) and
names where the scaled gradient first overflows: the float16 cast of the model output inside
the loss (``ToCopyBackward0``), cause ``overflow`` (finite in float64).
"""

from __future__ import annotations

import json

import pytest
import replay_models as R
import torch
from bundles import invoke_cli
from models import check_event
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from replay import replay
from replay.analyze import scale_of_the_step
from replay.load import read_step
from replay.rebuild import build
from replay.window import Change, run_window, window_of

pytestmark = pytest.mark.usefixtures("in_tests_dir")


@pytest.mark.parametrize("reason, settings, step", [
    ("scale_collapse", {"min_scale": 2.0 ** 38}, 2),  # 2**39, 2**38, 2**37 < min_scale
    ("scale_skipping", {"max_skipped_steps": 3}, 3),  # the fourth skip in a row
])
def test_a_scale_event_replays_to_the_overflowing_scaled_gradient(out_dir, reason, settings,
                                                                   step):
    model, crit = R.make_mlp(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)
    used = []  # the scale each step's backward ran with, as the loop saw it
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, scaler=scaler,
                            factory="replay_models:make_mlp", **settings):
            for s in range(8):
                x, y = R.batch(s)
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = crit(model(x), y)
                used.append(scaler.get_scale())
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
    err = info.value
    check_event(err.event, step=step, reason=reason, phase="backward", kind="scale")
    assert scale_of_the_step(read_step(err.bundle_path)) == used[step]

    rep = replay(err.bundle_path)
    assert rep["event"]["step"] == step and rep["event"]["kind"] == "scale"
    assert rep["reproduced"] is True and rep["cause"] == "overflow"
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["made"]) == \
        ("backward", "<loss>", "ToCopyBackward0", "+inf"), o
    assert invoke_cli(err.bundle_path).exit_code == 0


@pytest.mark.parametrize("rewind", [None, 2])
def test_a_scale_events_window_and_tries_rerun_the_scaled_backward(out_dir, rewind):
    """The what-ifs (and the rewind window) of a GradScaler event re-run the event step's
    backward scaled, as training ran it: its overflow is the event, so the window reproduces
    it, float32 fixes it and a smaller learning rate does not. (Unscaled, every try was
    'finite'; with a window, the event step's overflow was a skip, so 'did NOT come back'.)"""
    model, crit = R.make_mlp(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, scaler=scaler,
                            factory="replay_models:make_mlp", max_skipped_steps=3,
                            rewind=rewind):
            for s in range(8):
                x, y = R.batch(s)
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = crit(model(x), y)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
    err = info.value
    check_event(err.event, step=3, reason="scale_skipping", phase="backward", kind="scale")
    res = invoke_cli(err.bundle_path, "--json", "--try", "dtype=float32", "--try", "lr=0.1x")
    rep = json.loads(res.stdout)
    if rewind:
        w = rep["window"]
        assert w["reproduced"] and w["event_step"] == 3, w
        assert (w["first_non_finite"]["step"], w["first_non_finite"]["phase"]) == (3, "backward")
    tries = {t["try"]: t for t in rep["what_if"]}
    assert tries["dtype=float32"]["finite"] and not tries["dtype=float32"]["inconclusive"]
    lr = tries["lr=0.1x"]
    if not rewind:  # the step's own update comes after its backward event: nothing to change
        assert lr["finite"] is None and "rewind=N" in lr["note"]
        return
    assert not lr["finite"] and not lr["inconclusive"]
    assert (lr["event_step"], lr["origin"]["phase"]) == (3, "backward")


def test_the_window_reruns_a_skipped_step_with_the_scale_its_backward_used(out_dir):
    """A skipped step's scale is read after scaler.update() halved it; the window must undo
    that backoff. This MLP's float16 gradients overflow at 2**18 and not at 2**17: step 0 was
    skipped in training, and re-run at 2**17 it trained instead (a different run)."""
    model, crit = R.make_mlp(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 18)
    skipped = []
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, scaler=scaler,
                            factory="replay_models:make_mlp", rewind=4):
            for s in range(6):
                x, y = R.batch(s)
                if s == 4:
                    x[2, 0] = float("nan")
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = crit(model(x), y)
                scaler.scale(loss).backward()
                before = scaler.get_scale()
                scaler.step(opt)
                scaler.update()
                skipped.append(scaler.get_scale() < before)
    check_event(info.value.event, step=4, phase="input")
    assert skipped[:4] == [True, False, False, False]
    rep = json.loads(invoke_cli(info.value.bundle_path, "--json").stdout)
    w = rep["window"]
    assert w["reproduced"] and w["steps"] == [0, 4]
    assert [s["skipped"] for s in w["per_step"][:4]] == skipped[:4]
    # a what-if's backward starts from its own loss (not the recorded output gradients), so
    # the scale it multiplies the loss by decides the skip
    step = read_step(info.value.bundle_path)
    build(step, None, None)
    run = run_window(step, window_of(step), Change(lr_factor=1.0))
    assert [s["skipped"] for s in run.per_step[:4]] == skipped[:4]
