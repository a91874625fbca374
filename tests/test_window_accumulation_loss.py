"""A rewind window over steps of gradient accumulation (``loss_fn(...) / n`` backpropagated
per micro-batch): each re-run step's loss is the one training logged and recorded (the mean
of its micro-batches' ``loss_fn`` outputs), not their sum, n times it; a batch-size ramp that
raises the micro-batches per step is no loss jump."""

from __future__ import annotations

import pytest
import torch
from bundles import invoke_cli, nanreplay_json
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from recorder.bundle import read_bundle

pytestmark = pytest.mark.usefixtures("in_tests_dir")

BAD_ROW, BAD_FEATURE = 2, 1


def train(out_dir, micro_batches: list[int]):
    """AdamW over a tiny MLP, step k accumulating ``micro_batches[k]`` micro-batches; a NaN
    feature in a row of the last step's last micro-batch. Returns the event and the loss the
    loop logged at each step (the sum of its divided micro-batch losses)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    crit, g, logged = nn.MSELoss(), torch.Generator().manual_seed(1), []
    with pytest.raises(NonFiniteError) as info, \
            FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, rewind=4):
        for step, n in enumerate(micro_batches):
            opt.zero_grad()
            total = 0.0
            for i in range(n):
                x, y = torch.randn(6, 4, generator=g), torch.randn(6, 1, generator=g)
                if step == len(micro_batches) - 1 and i == n - 1:
                    x[BAD_ROW, BAD_FEATURE] = float("nan")
                loss = crit(model(x), y) / n
                loss.backward()
                total += loss.item()
            logged.append(total)
            opt.step()
    return info.value, logged


def check_window(err, logged: list[float], micro_batches: list[int]) -> dict:
    """The report's event (step, micro-batch, row, cause) as planted, and every window step
    before it with the loss the loop logged and the ring recorded."""
    rep = nanreplay_json(err.bundle_path)
    event = len(micro_batches) - 1
    o, w = rep["origin"], rep["window"]
    assert (rep["event"]["step"], o["micro_batch"], o["samples"], rep["cause"]) == (
        event, micro_batches[-1] - 1, [BAD_ROW], "input"), (rep["event"], o, rep["cause"])
    assert (w["reproduced"], w["event_step"]) == (True, event), w
    _, tensors = read_bundle(err.bundle_path)
    ring = dict(zip(tensors["ring/steps"].tolist(), tensors["ring/loss"].tolist()))
    got = {s["step"]: s["loss"] for s in w["per_step"] if s["step"] < event}
    assert len(got) >= 4, w["per_step"]
    for k, v in got.items():
        assert v == pytest.approx(logged[k], rel=1e-6) == ring[k], (k, v, logged[k], ring[k])
    return w


@pytest.mark.parametrize("n", [1, 2, 4])
def test_window_losses_are_the_logged_losses_under_accumulation(tmp_path, n):
    micro_batches = [n] * 7
    err, logged = train(tmp_path, micro_batches)
    w = check_window(err, logged, micro_batches)
    assert w["precursors_began"] is None, w["precursors_began"]


def test_more_micro_batches_per_step_is_no_loss_jump(tmp_path):
    """1 micro-batch a step, then 16 (a batch-size ramp): the loss per step stays the mean,
    so the window names no step where the trouble began (the sum jumped 16x)."""
    micro_batches = [1, 1, 1, 16, 16]
    err, logged = train(tmp_path, micro_batches)
    w = check_window(err, logged, micro_batches)
    assert w["precursors_began"] is None, w["precursors_began"]
    text = invoke_cli(err.bundle_path).stdout
    assert "window " in text and " began " not in text, text
