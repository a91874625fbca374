"""An optimizer event whose update closed no recorded step (the bundle's event says
``no_step_closed``): ``optimizer.step()`` ran with no forward of the recorded model before it,
only its submodules (a training method other than ``forward``: stable-baselines3's SAC updates
its actor through ``actor.action_log_prob``), so no step was open, its loss and gradients were
never checked, and the weights it broke were first found by a later check (a rollout's
evaluation forward). Nothing of that update is in the bundle: the hint says so, with the
learning rate it ran at, instead of the generic "finite gradients became non-finite weights",
which nothing here saw. When the gradients the bundle holds for the broken weights are
non-finite (``.grad`` as the later check found it), the update may only have applied NaN it
was given (DP-SGD under ``vmap`` whose clip divided a zero per-sample gradient by its norm),
which no learning rate helps, or a backward through weights earlier updates grew overflowed
(SAC's actor at lr=100): the hint names both, the bundle cannot tell them apart.
"""

from __future__ import annotations

from typing import Any

import torch

UNRECORDED_UPDATE = (
    "{cls}'s update made {param} non-finite in an optimizer.step() that closed no recorded "
    "step: no forward of the recorded model ran before it with gradients on, only its "
    "submodules (a training method other than forward: stable-baselines3's SAC updates its "
    "actor through actor.action_log_prob, PPO its policy through policy.evaluate_actions) or "
    "the model under torch.func transforms (vmap, grad, jvp), which are not recorded, so its "
    "loss and gradients were never checked and the bundle holds only the weights it left")
ADVICE = ("; {lr}lower the learning rate or clip the gradients (SB3's max_grad_norm), and to "
          "have such updates recorded, give FlightRecorder a module whose forward the "
          "update's loss comes through")

# the note in place of findings.UPDATE_NOT_RERUN: guard_optimizer copies the weights of a step
# it closes, and this update closed none
UNRECORDED_NOT_RERUN = (
    "the bundle holds the weights after the update that made them non-finite, and that update "
    "closed no recorded step, so nothing of it (its batch, loss, gradients, the weights before "
    "it) was kept: it cannot be re-run, with guard_optimizer=True either")


# of such an update, when the gradients the bundle holds for the weights it broke are
# non-finite: .grad as the later check found it, the update's own or a later backward's
GIVEN_NON_FINITE = (
    "; the bundle's gradients of {grads} hold {kinds} (.grad as a later forward found the "
    "weights broken): either earlier updates grew the weights until a backward overflowed "
    "({lr}lower the learning rate or clip the gradients: SB3's max_grad_norm), or the update "
    "was given them non-finite, which no learning rate helps: look where they were made, a "
    "per-sample clip under vmap dividing a zero gradient by its zero norm (0/0), .grad "
    "written by the loop; calling the model once outside the transforms with gradients on "
    "in each step (the forward of the loss you log) makes each update a step whose gradients "
    "are checked before it, at its step")


def given_non_finite(step, params: list[str]) -> list[str]:
    """The broken parameters whose gradients in the bundle are non-finite, in order."""
    return [n for n in params if (g := step.tensors.get(f"grads/{n}")) is not None
            and g.is_floating_point() and not bool(torch.isfinite(g).all())]


def unrecorded_update_hint(step, params: list[str]) -> str | None:
    """The hint of an update event marked ``no_step_closed``; None for any other."""
    if not step.event.get("no_step_closed") or not params:
        return None
    opt: dict[str, Any] = step.meta.get("optimizer") or {}
    groups = [g for g in opt.get("param_groups", []) if set(g.get("params") or ()) & set(params)]
    lrs = sorted({g["lr"] for g in groups if isinstance(g.get("lr"), (int, float))})
    lr = f"it ran at lr={', '.join(f'{v:g}' for v in lrs)}: " if lrs else ""
    cls = opt.get("class", "").rpartition(".")[2] or "the optimizer"
    if not (given := given_non_finite(step, params)):
        return UNRECORDED_UPDATE.format(cls=cls, param=params[0], lr=lr) + ADVICE.format(lr=lr)
    kinds = sorted({k for n in given for k, bad in (
        ("nan", step.tensors[f"grads/{n}"].isnan()),
        ("inf", step.tensors[f"grads/{n}"].isinf())) if bool(bad.any())})
    more = f" (+{len(given) - 1} more)" if len(given) > 1 else ""
    return UNRECORDED_UPDATE.format(cls=cls, param=params[0]) + GIVEN_NON_FINITE.format(
        grads=given[0] + more, kinds=" and ".join(kinds), lr=lr)
