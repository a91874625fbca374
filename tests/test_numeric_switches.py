"""Process-wide numeric switches a training script sets once (``torch.set_flush_denormal``,
the default dtype, deterministic mode, the float32 matmul precision) are recorded in the
bundle's ``env`` and set again by the replay, which runs in a fresh process with torch's
defaults. Before, a step whose 0/0 came from a flushed subnormal replayed as 'NOT reproduced'
with a backward +inf in DivBackward0, and a float64 run's eps constant, 0 in float32, made the
replay name a log's -inf the run never made."""

from __future__ import annotations

import math

import numeric_switches_models as M
import pytest
import torch
from bundles import nanreplay_json
from torch import nn

from recorder import FlightRecorder, NonFiniteError

K, ROW = 3, 5
SUBNORMAL = (math.log(2.0 ** -149), math.log(torch.finfo(torch.float32).tiny))

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def _far_row(model: M.SoftAssign) -> torch.Tensor:
    """A record whose kernel value exp(-d2/2) at every centre is float32-subnormal: the
    constant c that puts the middle of the exponents' range at its mean (in float64)."""
    m = model.centres.detach().double()
    target = -sum(SUBNORMAL) / 2  # d2 / 2 at the range's middle
    lo, hi = 1.0, 100.0  # (d2 grows with c past the centres, which are near 0)
    for _ in range(60):
        c = (lo + hi) / 2
        lo, hi = (c, hi) if float((c - m).pow(2).sum(-1).mean()) / 2 < target else (lo, c)
    x = torch.full((m.shape[1],), (lo + hi) / 2, dtype=torch.float64)
    logk = -(x - m).pow(2).sum(-1) / 2
    assert bool(((logk > SUBNORMAL[0]) & (logk < SUBNORMAL[1])).all()), logk
    return x.float()


def test_flushed_subnormals_are_flushed_in_the_replay_too(out_dir):
    torch.manual_seed(0)
    model = M.make_soft_assign()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    crit = nn.CrossEntropyLoss()
    torch.set_flush_denormal(True)
    try:
        with pytest.raises(NonFiniteError) as info:
            with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                                factory="numeric_switches_models:make_soft_assign"):
                for step in range(K + 2):
                    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
                    if step == K:
                        x[ROW] = _far_row(model)
                    opt.zero_grad()
                    crit(model(x), y).backward()
                    opt.step()
    finally:
        torch.set_flush_denormal(False)  # (the replay's process: torch's default)
    assert (info.value.event["step"], info.value.event["phase"]) == (K, "forward")
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"]) == \
        ("forward", "", "aten.div", [ROW]), o
    assert rep["reproduced"] and rep["cause"] == "underflow", rep["hint"]
    # (the switch is said: set once, far from the op, it made the 0 IEEE arithmetic keeps)
    assert [p for p in rep["problems"] if "torch.set_flush_denormal(True)" in p], rep["problems"]
    assert (torch.tensor([1e-38]) * 0.5).item() != 0  # put back after the replay


PAIR = 2


def test_a_float64_runs_constants_stay_float64_in_the_replay(out_dir):
    """A float64 run's ``torch.tensor(1e-60)`` eps, which the replay's float32 default made
    0: it named the -inf of a coincident pair's log (samples [2, 6], 'underflow'), which the
    run never made, for the sqrt of a negative energy."""
    torch.manual_seed(0)
    torch.set_default_dtype(torch.float64)
    try:
        model = M.make_pair_potential()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        crit = nn.MSELoss()
        with pytest.raises(NonFiniteError) as info:
            with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                                factory="numeric_switches_models:make_pair_potential"):
                for step in range(K + 2):
                    x, y = torch.randn(8, 2), torch.ones(8)
                    x[PAIR, 1] = x[PAIR, 0]  # log(1e-60): finite in float64
                    if step == K:  # far out where lin(x) < 0, the pair apart: e << -1
                        w = model.lin.weight.detach()[0]
                        x[ROW] = -1e6 * w.sign() * torch.tensor([1.0, 2.0])
                    opt.zero_grad()
                    crit(model(x), y).backward()
                    opt.step()
    finally:
        torch.set_default_dtype(torch.float32)  # (the replay's process: torch's default)
    assert (info.value.event["step"], info.value.event["phase"]) == (K, "forward")
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"], o["made"]) == \
        ("forward", "", "aten.sqrt", [ROW], "nan"), o
    assert rep["reproduced"] and rep["cause"] == "invalid", rep["hint"]
    assert torch.get_default_dtype() == torch.float32  # put back after the replay
