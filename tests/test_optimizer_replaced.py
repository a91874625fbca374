"""An optimizer made after the recorder (a second training phase that builds a new one): the
recorded optimizer never steps, so no step closed, nothing was checked and every batch stayed
referenced (up to ``max_micro_batches``, 1024 of them: device memory), and the NaN that came
was reported at step 0 as weights when the ``with`` block ended. The recorder now notices the
weights moving under an open step, says so once, closes a step at each forward, and the event
is the planted one, at its step; LBFGS, whose own updates run inside ``step()``, is no such
case."""

from __future__ import annotations

import logging

import pytest
import replay_models as R
import torch
from bundles import invoke_cli
from models import check_event
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from recorder.foreign import WARNING

K = 5  # the step whose sample 5 drives ShiftedLog below its domain


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def nanreplay_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "nanreplay"]


def test_an_optimizer_made_after_the_recorder_is_said_and_the_event_is_at_its_step(
        out_dir, caplog):
    torch.manual_seed(0)
    model = R.make_log_net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # phase 1's
    crit = nn.CrossEntropyLoss()
    with caplog.at_level("WARNING", logger="nanreplay"), pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, optimizer, loss_fn=crit, out_dir=out_dir,
                            factory="replay_models:make_log_net") as rec:
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05)  # phase 2: a new one
            for step in range(10):
                x, y = R.batch(step)
                if step == K:
                    x[5] *= 100.0
                optimizer.zero_grad()
                crit(model(x), y).backward()
                optimizer.step()
                if step == 2:
                    assert rec.step == 2 and len(rec.cycle.tape.micro_batches) == 1
    assert nanreplay_warnings(caplog) == [WARNING]
    check_event(info.value.event, step=K, phase="forward", module="act", samples=[5])
    r = invoke_cli(info.value.bundle_path)
    assert r.exit_code == 1, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == (f"nanreplay: step {K}, forward event — not re-run (weights written "
                        "after its forward)")
    assert "  samples    [5]" in lines
    assert any(s.startswith("  note       the optimizer given to FlightRecorder never stepped")
               for s in lines), lines


def test_lbfgs_updating_inside_its_step_is_not_another_optimizer(out_dir, caplog):
    """LBFGS evaluates its closure again after each of its updates, inside step(): each
    evaluation is a step of its own (see test_optimizer_loops), whose weights its own updates
    move; none of that is another optimizer's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5)
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(1))
    y = x.sum(1, keepdim=True)
    with caplog.at_level("WARNING", logger="nanreplay"):
        with FlightRecorder(model, opt, loss_fn=nn.MSELoss(), out_dir=out_dir) as rec:
            for _ in range(4):
                def closure():
                    opt.zero_grad()
                    loss = rec.loss_fn(model(x), y)
                    loss.backward()
                    return loss
                opt.step(closure)
                model(x[:8])  # a forward after step() returned: its updates are its own
    # 4 step() calls of 5 closure evaluations, a step each; each extra forward joins the
    # next evaluation's step; the last one, which no backward followed, is checked at the
    # exit as an evaluation, not counted
    assert nanreplay_warnings(caplog) == [] and rec.event is None and rec.step == 20


def test_the_recorded_optimizer_with_gradient_accumulation_is_not_warned(out_dir, caplog):
    torch.manual_seed(0)
    model = R.make_log_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    crit = nn.CrossEntropyLoss()
    with caplog.at_level(logging.WARNING, logger="nanreplay"):
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir) as rec:
            for step in range(4):
                opt.zero_grad()
                for mb in range(3):
                    x, y = R.batch(10 * step + mb)
                    (crit(model(x), y) / 3).backward()
                opt.step()
    assert nanreplay_warnings(caplog) == [] and rec.event is None and rec.step == 4
