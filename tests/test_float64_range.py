"""A float64 model whose values pass float32's range and stay finite: the recorder's statistics
are float32 slots, where a float64 output of -2.7e117 (or a gradient norm of 1e50) read as
-Inf, a false event that stopped a healthy run (a precision fuzz found it: a float64 model's
``exp(200 * h)``). A finite float64 value now sits at float32's largest in its slot; a real
infinity is still one."""

from __future__ import annotations

import json

import pytest
import torch
from bundles import invoke_cli
from torch import nn

from recorder import FlightRecorder, NonFiniteError


class Scaled(nn.Module):
    """Features carried at a scale far beyond float32's (a physical quantity in SI units, a
    likelihood before its log), brought back before the head."""

    def __init__(self, power: float = 1.0):
        super().__init__()
        self.lin = nn.Linear(4, 8)
        self.power = power

    def forward(self, x):
        return torch.exp(self.power * self.lin(x))


class Net(nn.Module):
    def __init__(self, power: float):
        super().__init__()
        self.up = Scaled(power)
        self.head = nn.Linear(8, 1)
        self.power = power

    def forward(self, x):  # (an output in units of 1e100, as a physical model may give it)
        return self.head(torch.log(self.up(x)) / self.power) * 1e100


def make_net():
    torch.manual_seed(0)
    return Net(power=200.0).double()


def _train(model, loss_scale: float, steps: int, out_dir=None, big_at: int | None = None):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3 / loss_scale)
    crit = nn.MSELoss()
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory="test_float64_range:make_net") if out_dir else None
    g = torch.Generator().manual_seed(1)
    losses = []
    try:
        if rec is not None:
            rec.attach()
        for step in range(steps):
            x = torch.randn(6, 4, generator=g, dtype=torch.float64)
            y = torch.randn(6, 1, generator=g, dtype=torch.float64)
            if step == big_at:
                x[3] = 40.0  # exp(200 * lin(x)) past float64's range too: a real +Inf
            loss = crit(model(x) / 1e100, y) * loss_scale
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    finally:
        if rec is not None:
            rec.detach()
    return losses


@pytest.mark.usefixtures("in_tests_dir")
def test_float64_values_beyond_float32s_range_train_as_without_the_recorder(out_dir):
    """exp(200 * lin(x)) reaches ~1e175 inside, the model's output is in units of 1e100 and the
    loss is scaled by 1e50: all finite in float64. Before: a forward event at step 0, '+Inf
    ... first made by module <root>'."""
    base = _train(make_net(), 1e50, 4)
    got = _train(make_net(), 1e50, 4, out_dir=out_dir)
    assert got == base and all(abs(v) < float("inf") for v in got)
    assert not out_dir.exists() or not list(out_dir.iterdir())


@pytest.mark.usefixtures("in_tests_dir")
def test_a_real_float64_overflow_is_still_the_event_and_its_op(out_dir):
    with pytest.raises(NonFiniteError) as info:
        _train(make_net(), 1.0, 4, out_dir=out_dir, big_at=2)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (2, "forward", "up", "+inf")
    rep = json.loads(invoke_cli(info.value.bundle_path, "--json").stdout)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["samples"], rep["cause"]) == \
        (True, "up", "aten.exp", [3], "overflow"), rep
