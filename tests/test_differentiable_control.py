"""End to end on differentiable control (``differentiable_control_models``): a point-mass
policy under a log barrier, a differentiable MPC layer's Riccati recursion by Cholesky, a
cart-pole policy trained through its simulator with per-episode control periods, and a learned
pendulum model whose loss wraps angles with ``atan2``. Each planted bug of the domain fires
under the recorder and is replayed with the CLI; the healthy versions raise no event and train
bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import differentiable_control_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("differentiable_control_models.py", text)


def batch(kind: str, g: torch.Generator, bad: int | None):
    """(model args, loss args after the model's outputs) of one step."""
    if kind == "barrier":
        x0, goal = M.start_states(g, outside=bad)
        return (x0,), (goal,)
    if kind == "mpc":
        x0, u_star = M.pendulum_states(g, fallen=bad)
        return (x0,), (u_star,)
    if kind == "cartpole":
        return M.cartpole_batch(g, slow=bad), ()
    if kind == "pinet":
        x0, u_star = M.expert_batch(g, far=bad)
        return (x0,), (u_star,)
    x, u, y, mask = M.episodes(g, short=bad)
    return (x, u, mask), (y, mask)


LOSSES = {"barrier": M.barrier_loss, "cartpole": M.cartpole_cost, "dynamics": M.angle_loss,
          "circle": M.angle_loss_on_circle}


def train(kind: str, make: str, out_dir, bad: int | None = None, steps: int = 4,
          record: bool = True):
    """Adam with a step schedule and gradient clipping, as control-learning code trains; the
    sample ``bad`` is planted in the last step's batch. Returns the model."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    crit = LOSSES.get(kind, torch.nn.MSELoss())
    g = torch.Generator().manual_seed(0)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"differentiable_control_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for step in range(steps):
            args, targets = batch(kind, g, bad if step == steps - 1 else None)
            out = model(*args)
            loss = loss_fn(*(out if isinstance(out, tuple) else (out,)), *targets)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
    return model


def fire(kind: str, make: str, tmp_path, bad: int):
    with pytest.raises(NonFiniteError) as info:
        train(kind, make, tmp_path, bad)
    return info.value.event, info.value.bundle_path
