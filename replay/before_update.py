"""NaN weights blamed on an update that cannot have made them: they were NaN before it.

The recorder checks what an update wrote with the next step's host read, so NaN that the
loop writes into the weights after ``optimizer.step()`` (OpenKE-style TransE renormalises its
entities there, ``w.data = w / w.norm(dim=1, keepdim=True)``, a 0/0 on a zero padding row)
reaches the next update unseen, and the next update's evidence shows it: an ``optimizer``
event whose bundle holds the weights after the update. An elementwise update of a finite
weight by a finite gradient and finite state is finite (or overflows to +-inf, never NaN)
while its hyper-parameters are finite and its eps is above 0: where the state the bundle
holds after it and the gradient are finite, a NaN weight was NaN before the update.

The bundle's gradients are those of the step whose host read found the event, which ran its
forward and backward on the NaN weights when the loop wrote them before the update instead
(RigL's regrowth under ``no_grad`` between ``backward()`` and ``step()``): NaN there says
nothing of the gradient the update took. The ring's total gradient norm of the event's step
does: finite, every gradient that update took was finite.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .findings import finish, origin_fields
from .load import Step

__all__ = ["nan_before_update"]

# torch.optim's updates that act entry by entry (no norm of the whole weight: LARS, LAMB's
# trust ratio, Adafactor's factored second moment are not), by class name
ELEMENTWISE = {"SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adamax", "NAdam", "RAdam",
               "SparseAdam", "Adadelta"}


def nan_before_update(report, step: Step, params: list[str]) -> dict[str, Any] | None:
    """The report of NaN weights the update at the event cannot have made (see the module),
    named with their rows; None when it may have (a non-finite gradient or state there, an
    optimizer that is not elementwise, another kind)."""
    opt = step.meta.get("optimizer") or {}
    if step.event.get("kind") != "nan" or opt.get("class", "").rpartition(".")[2] \
            not in ELEMENTWISE:
        return None
    name = params[0] if params else None
    w = step.tensors.get(f"weights/{name}")
    if w is None or not w.is_floating_point() or not _eps_above_0(opt, name):
        return None
    nan = torch.isnan(w)
    took_finite = _update_grads_finite(step)
    beside = [t for k, t in step.tensors.items()
              if ((k == f"grads/{name}" and not took_finite) or k.startswith(f"optim/{name}/"))
              and t.shape == w.shape and t.is_floating_point()]
    if not nan.any() or any(not bool(torch.isfinite(t[nan]).all()) for t in beside) \
            or _negative_second_moment(step, name, nan):
        return None
    rows = nan.reshape(len(w), -1).any(1).nonzero().flatten().tolist() if w.dim() else [0]
    cls = opt["class"].rpartition(".")[2]
    report["problems"].append(
        f"the bundle holds {name} after {cls}'s update at step {step.event.get('step')}, "
        f"NaN in rows {rows[:8]}; the gradient and the optimizer's state are finite there, "
        f"and {cls}'s update of a finite weight with them is finite: the weight was NaN "
        "before the update, not made by it"
        + (" (the bundle's gradients are of a later step, made from those NaN weights; the "
           "ring's gradient norm of the update is finite)" if took_finite else ""))
    origin = origin_fields(phase="weights", param=name, params=[name], made="nan",
                           rows=rows, rows_of=len(w) if w.dim() else 1)
    return finish(report, origin, "weights", reproduced=False, hint=(
        f"{name} was NaN in rows {rows[:8]} before the update at step "
        f"{step.event.get('step')} (which the recorder blamed: it checks an update's weights "
        "at the next step), and every earlier check saw it finite: code that writes the "
        "weights between the updates made the NaN: the loop after optimizer.step() (a "
        "renormalisation w / w.norm() of a zero row: a padding row, an entity no batch has "
        "looked up; a projection, a copy), or between backward() and optimizer.step() (a "
        "pruned or regrown connection's new value, a re-initialised unit's: a statistic of "
        "an empty set, a division by a zero norm), or the forward in place; use F.normalize or "
        "norm.clamp_min(eps) there, or record with guard_optimizer=True, which checks the "
        "weights right after each update"))


# state the update takes the square root of: finite but negative there (a checkpoint's state
# edited or converted wrongly, exp_avg and exp_avg_sq swapped) the update makes NaN itself
SQRT_STATE = ("exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum", "acc_delta")


def _negative_second_moment(step: Step, name: str, nan: torch.Tensor) -> bool:
    """A square-rooted state entry (after the update) below 0 where the weight is NaN."""
    return any(bool((t[nan] < 0).any()) for key in SQRT_STATE
               if (t := step.tensors.get(f"optim/{name}/{key}")) is not None
               and t.shape == nan.shape and t.is_floating_point())


def _update_grads_finite(step: Step) -> bool:
    """The ring's total gradient norm at the event's step is finite: every gradient the
    blamed update took was finite."""
    at, steps = step.event.get("step"), step.tensors.get("ring/steps")
    norms = step.tensors.get("ring/grad_norm")
    if at is None or steps is None or norms is None:
        return False
    hit = (steps == at).nonzero()
    return bool(len(hit)) and math.isfinite(float(norms[int(hit[0, 0])]))


def _eps_above_0(opt: dict, name: str | None) -> bool:
    """The groups holding ``name`` divide by an eps above 0 (or by nothing): 0/0 can be
    made by an update with eps=0 of finite state (Adam's m / (sqrt(v) + 0) at m = v = 0)."""
    for g in opt.get("param_groups", []):
        if name in (g.get("params") or ()):
            eps = g.get("eps", 1.0)  # (SGD's: none)
            return isinstance(eps, (int, float)) and eps > 0
    return True
