"""What-ifs on a loop that accumulates gradients over micro-batches with ``loss / k``: the
tries re-run the loss from the loss function, so they must scale it as the loop did (the
factor the recorded output gradients hold). Unscaled, every try ran with k times training's
gradients: ``--try lr=1x``, which changes nothing, went non-finite 8 steps before the
recorded event."""

from __future__ import annotations

import math

import pytest
import rewind_models as R
import torch
from test_rewind import nanreplay, what_if
from test_rewind_began import warmup_cosine
from torch import nn

from recorder import FlightRecorder, NonFiniteError

ACCUMULATE = 4


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def accumulating_run(out_dir, peak_lr: float, lr_factor_from: int | None = None,
                     factor: float = 1.0, until: int = 200):
    """SGD with momentum under warmup + cosine, 4 micro-batches a step, each ``loss / 4``;
    from step ``lr_factor_from`` on, every update's learning rate times ``factor`` (what
    ``--try lr=FACTORx`` claims to re-run). The step of the first non-finite loss, or None."""
    torch.manual_seed(0)
    model = R.make_gelu_regressor()
    opt = torch.optim.SGD(model.parameters(), lr=peak_lr, momentum=0.9, weight_decay=1e-4)
    sched = warmup_cosine(opt, warmup=10, total=200)
    w = torch.randn(16, 1, generator=torch.Generator().manual_seed(99))
    crit = nn.MSELoss()
    with FlightRecorder(model, opt, loss_fn=crit, lr_scheduler=sched, rewind=8, out_dir=out_dir,
                        factory="rewind_models:make_gelu_regressor"):
        for step in range(until):
            opt.zero_grad()
            for k in range(ACCUMULATE):
                g = torch.Generator().manual_seed(step * 10 + k)
                x = 2 * torch.randn(16, 16, generator=g)
                loss = crit(model(x), x @ w) / ACCUMULATE
                loss.backward()
                if not math.isfinite(loss.item()):
                    return step
            scale = factor if lr_factor_from is not None and step >= lr_factor_from else 1.0
            for group in opt.param_groups:
                group["lr"] *= scale
            opt.step()
            for group in opt.param_groups:
                group["lr"] /= scale
            sched.step()
    return None


def test_a_try_re_runs_the_loops_loss_scaling(out_dir, tmp_path):
    with pytest.raises(NonFiniteError) as info:
        accumulating_run(out_dir, 0.02)
    ev = info.value.event
    assert (ev["step"], ev["phase"]) == (26, "loss")
    rep = nanreplay(info.value.bundle_path, "lr=1x", "lr=0.5x")
    w = rep["window"]
    assert w["reproduced"] and w["steps"] == [16, 26]
    assert w["loss_factors"] == pytest.approx([1 / ACCUMULATE] * ACCUMULATE)
    tries = what_if(rep)
    same = tries["lr=1x"]  # no change: the recorded event, at its step (it read step 19)
    assert (same["finite"], same["event_step"], same["origin"]["phase"]) == (False, 26, "loss")
    assert tries["lr=0.5x"]["finite"] and not tries["lr=0.5x"]["inconclusive"]
    # half the rate from the window's copy on, re-trained: finite through the window, as the
    # try says
    assert accumulating_run(tmp_path / "b", 0.02, lr_factor_from=16, factor=0.5, until=27) is None
