"""An optimizer event whose update closed no recorded step (the bundle's event says
``no_step_closed``): ``optimizer.step()`` ran with no forward of the recorded model before it,
only its submodules (a training method other than ``forward``: stable-baselines3's SAC updates
its actor through ``actor.action_log_prob``), so no step was open, its loss and gradients were
never checked, and the weights it broke were first found by a later check (a rollout's
evaluation forward). Nothing of that update is in the bundle: the hint says so, with the
learning rate it ran at, instead of the generic "finite gradients became non-finite weights",
which nothing here saw.
"""

from __future__ import annotations

from typing import Any

UNRECORDED_UPDATE = (
    "{cls}'s update made {param} non-finite in an optimizer.step() that closed no recorded "
    "step: no forward of the recorded model ran before it, only its submodules (a training "
    "method other than forward: stable-baselines3's SAC updates its actor through "
    "actor.action_log_prob, PPO its policy through policy.evaluate_actions), so its loss and "
    "gradients were never checked and the bundle holds only the weights it left; {lr}lower the "
    "learning rate or clip the gradients (SB3's max_grad_norm), and to have such updates "
    "recorded, give FlightRecorder a module whose forward the update's loss comes through")

# the note in place of findings.UPDATE_NOT_RERUN: guard_optimizer copies the weights of a step
# it closes, and this update closed none
UNRECORDED_NOT_RERUN = (
    "the bundle holds the weights after the update that made them non-finite, and that update "
    "closed no recorded step, so nothing of it (its batch, loss, gradients, the weights before "
    "it) was kept: it cannot be re-run, with guard_optimizer=True either")


def unrecorded_update_hint(step, params: list[str]) -> str | None:
    """The hint of an update event marked ``no_step_closed``; None for any other."""
    if not step.event.get("no_step_closed") or not params:
        return None
    opt: dict[str, Any] = step.meta.get("optimizer") or {}
    groups = [g for g in opt.get("param_groups", []) if set(g.get("params") or ()) & set(params)]
    lrs = sorted({g["lr"] for g in groups if isinstance(g.get("lr"), (int, float))})
    lr = f"it ran at lr={', '.join(f'{v:g}' for v in lrs)}: " if lrs else ""
    cls = opt.get("class", "").rpartition(".")[2] or "the optimizer"
    return UNRECORDED_UPDATE.format(cls=cls, param=params[0], lr=lr)
