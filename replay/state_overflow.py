"""An update that made its optimizer state non-finite while the weights stayed finite (the
recorder's ``state`` event, see recorder.state_check).

Adam's ``exp_avg_sq`` is a running mean of squared gradients: a gradient above ~1.8e19 has a
square beyond float32's 3.4e38, so the state holds +inf, and every later update of that entry
is ``m / sqrt(inf) = 0``. Training stops there without a NaN: the weights stay finite and
still, the loss flattens. Nothing to re-run (the bundle holds the state after the update); the
hint names the state, the gradient that overflowed its square, and what makes gradients that
large: a scale the loss or the model multiplies in (a LoRA ``alpha / r``, an unnormalised
target), which clipping the gradients before the update bounds.
"""

from __future__ import annotations

import math
from typing import Any

from .domains import g
from .findings import STATE_AFTER_UPDATE, STATE_NOT_RERUN, finish, origin_fields
from .grown_number import number_attributes
from .infinite_scale import scale_report
from .load import Step

_F32_MAX = 3.4028234663852886e38
_LARGE = 1e6  # a float attribute this large is a scale, not a setting


def state_report(report: dict[str, Any], step: Step) -> dict[str, Any] | None:
    """The report of a ``state`` event, or of a GradScaler event whose scale itself is not
    finite (``replay.infinite_scale``: training state too, loaded or grown so); None for any
    other."""
    if (scaled := scale_report(report, step)) is not None:
        return scaled
    state = step.event.get("state")
    if not state or step.event.get("phase") != "optimizer":
        return None
    params = list(state)
    name, keys = params[0], state[params[0]]
    opt = step.meta.get("optimizer") or {}
    cls = opt.get("class", "").rpartition(".")[2] or "the optimizer"
    grad = step.tensors.get(f"grads/{name}")
    top = float(grad.detach().abs().max()) if grad is not None and grad.numel() else math.nan
    squared = math.isfinite(top) and top * top > _F32_MAX
    why = (f": its gradient reached {top:.3g}, whose square ({top * top:.3g}) is beyond "
           "float32's largest value 3.4e+38" if squared else "")
    more = f" (and of {len(params) - 1} more parameter(s))" if len(params) > 1 else ""
    hint = (f"{cls}'s update at step {step.event.get('step')} made its state "
            f"{', '.join(keys)} of {name}{more} non-finite while the weights stayed finite{why}; "
            "every later update of those entries divides by it (m / sqrt(inf) = 0 in Adam): "
            "those weights train no more, and the loss flattens with no NaN to stop on. Find "
            "what made the gradients that large (a scale the loss or the model multiplies in: "
            "a LoRA alpha / r, an unnormalised target or loss weight; see the precursors) and "
            "clip them before the update (torch.nn.utils.clip_grad_norm_)")
    if big := _largest_number(step):
        owner, k, v = big
        hint += (f". Here {owner}'s attribute {k} is {g(v)} as the step closed: a factor that "
                 "large multiplies into the gradients (a penalty weight grown with no cap, as "
                 "an augmented Lagrangian's rho without rho_max; a LoRA alpha / r): cap it")
    report["problems"].append(STATE_NOT_RERUN)  # (taken back by a window that re-runs it)
    origin = origin_fields(phase="optimizer", params=params, param=name,
                           made=step.event.get("kind"))
    report = finish(report, origin, "overflow" if squared else "optimizer", reproduced=False,
                    hint=hint)
    report["not_rerun"] = STATE_AFTER_UPDATE
    return report


def _largest_number(step: Step) -> tuple[str, str, float] | None:
    """(owner, attribute, value) of the largest plain float attribute of the loss or of a
    module (as the step closed, or as built) at or above ``_LARGE``, or None."""
    owners = ["<loss>", *(m.get("name") for m in step.meta.get("modules") or ())]
    found = [(o, k, v) for o in owners if o is not None
             for k, v in number_attributes(step, o, built=True).items()
             if type(v) is float and math.isfinite(v) and abs(v) >= _LARGE]
    if not found:
        return None
    o, k, v = max(found, key=lambda t: abs(t[2]))
    return ("the loss" if o == "<loss>" else o or "the model", k, v)
