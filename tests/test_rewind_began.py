"""Where a rewind window says the trouble began (``window.precursors_began``), on real training
loops whose weights crept up as training makes them, then blew up after one step: the step
that blew them up is named, not "the weights rose at every step: it began before the window".
"""

from __future__ import annotations

import math

import pytest
import rewind_models as R
import torch
from test_rewind import nanreplay
from torch import nn

from recorder import FlightRecorder, NonFiniteError

BAD_STEP = 40


def warmup_cosine(opt, warmup: int = 20, total: int = 400):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / warmup if s < warmup else
                                             0.5 * (1 + math.cos(math.pi * (s - warmup)
                                                                 / (total - warmup))))


def bad_record_run(out_dir):
    """SGD with momentum and weight decay under warmup + cosine; at step 40 one record's
    target is in the wrong unit (1e5x): the loss jumps, the weights blow up, and the third
    step after it overflows a Linear."""
    torch.manual_seed(0)
    model = R.make_price_regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    sched = warmup_cosine(opt)
    w = torch.randn(20, 10, generator=torch.Generator().manual_seed(99))
    crit = nn.MSELoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, lr_scheduler=sched, rewind=8,
                            out_dir=out_dir, factory="rewind_models:make_price_regressor"):
            for step in range(100):
                x = torch.randn(32, 20, generator=torch.Generator().manual_seed(step))
                y = x @ w
                if step == BAD_STEP:
                    y[3] *= 1e5
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
                sched.step()
    return info.value


def test_one_bad_batch_that_blew_up_slowly_growing_weights_is_where_it_began(out_dir):
    err = bad_record_run(out_dir)
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (43, "forward", "2")
    w = nanreplay(err.bundle_path)["window"]
    assert w["reproduced"] and w["steps"] == [32, 43]
    norms = [s["param_norm"] for s in w["per_step"][:-1]]
    assert all(a < b for a, b in zip(norms, norms[1:]))  # the weights rose at every step
    assert norms[BAD_STEP - 32 - 1] < 2 * norms[0]  # but barely, until the bad batch
    began = w["precursors_began"]
    # the loss jumped first at that step (the gradient norm and the weights followed it); it
    # read "step 32: the weight norm rose at every step of the window: it began before it"
    assert (began["step"], began["kind"]) == (BAD_STEP, "loss_jump"), began
    assert "before the window" not in began["detail"]


def test_the_hint_of_an_overflow_of_blown_up_weights_says_where_they_blew_up(out_dir):
    """The hint said only what float64 would hold at the Linear (rescale its inputs or compute
    it in float64), which the next steps' growth overflows too."""
    rep = nanreplay(bad_record_run(out_dir).bundle_path)
    assert rep["cause"] == "overflow" and rep["origin"]["op"] == "aten.addmm"
    assert ". But the weight norm grew " in rep["hint"]
    assert "x over the updates of steps 40-42, from where the rewind window shows the trouble " \
           "began (the loss " in rep["hint"]
    assert rep["hint"].endswith("or lower the learning rate or clip the gradients (--try lr=0.1x "
                                "and clip=1.0 re-run the bundle's rewind window with either)")
    assert rep["hint"].count("the run was diverging") == 1, rep["hint"]


def test_a_learning_rate_jump_in_a_second_parameter_group_is_where_it_began(out_dir):
    """A head whose group's schedule multiplies its rate by 1e7 from step 20 (a wrong base at
    unfreezing), the body's left as it was: the window looked at the first group's rate
    alone and named the weights that the jump blew up."""
    torch.manual_seed(0)
    model = R.make_price_regressor()
    body, head = nn.Sequential(*model[:4]), model[4]
    opt = torch.optim.SGD([{"params": body.parameters()}, {"params": head.parameters()}],
                          lr=0.01, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, [lambda s: 1.0,
                                                    lambda s: 1e7 if s >= 20 else 1.0])
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, lr_scheduler=sched, rewind=8,
                            out_dir=out_dir, factory="rewind_models:make_price_regressor"):
            for step in range(100):
                x = torch.randn(32, 20, generator=torch.Generator().manual_seed(step))
                opt.zero_grad()
                crit(model(x), x[:, :10].argmax(1)).backward()
                opt.step()
                sched.step()
    w = nanreplay(info.value.bundle_path)["window"]
    assert w["reproduced"] and w["steps"][0] < 20 < info.value.event["step"]
    assert [s["group_lrs"][1] for s in w["per_step"][:2]] == [0.01, 0.01]
    began = w["precursors_began"]
    assert (began["step"], began["kind"]) == (20, "lr_jump"), began
    assert began["detail"].startswith("the learning rate (parameter group 1) 1e+05 is 1e+07x")
