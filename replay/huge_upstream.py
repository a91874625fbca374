"""A backward overflow the loss sent down: the gradient entering the model's output (recorded
where the loss is computed outside the recorder, ``outgrad/*``) was already so large that the
model's backward, which multiplies it by activations and weights and sums it over positions,
left the type's range. The node it overflowed in has no fault of its own (a normalisation's
``rsqrt`` far from its pole, a ``mm``); the loss's scale is what to change: DPO's ``beta`` of
1e38, a reward scale, a loss weight, the reciprocal of a temperature near 0.

Or a GradScaler's scale, the recorder given the scaler: a float16 gradient the scale took past
the type's range is how the scaler finds its scale, and ``scaler.step(opt)`` skips that step
(no event); a backward event there means the loop's ``opt.step()`` ran on those gradients
itself (after ``scaler.unscale_(opt)`` for clipping), past the scaler's skip."""

from __future__ import annotations

import math

import torch

from .cause_result import Cause
from .compat import tree_leaves
from .recorded import scaler_state
from .transforms import outside_transforms

# sqrt of float32's largest value: a gradient beyond it overflows at any product with a factor
# as large, and no loss scaling reaches it (a GradScaler's scale is at most 2**24)
HUGE = 2.0 ** 64
# how much larger than the model's outputs: a loss that only compares the outputs (a squared
# error of a model that diverged) sends a gradient of their size
RATIO = 2.0 ** 32


def entering_max(step) -> float | None:
    """The largest magnitude among the step's recorded gradients of the model's outputs (None
    when none was recorded, or one is non-finite: that is another report's)."""
    top = None
    for key, t in step.tensors.items():
        if key.startswith("outgrad/") and isinstance(t, torch.Tensor) and t.is_floating_point() \
                and t.numel():
            m = t.detach().abs().max().item()
            if not math.isfinite(m):
                return None
            top = m if top is None else max(top, m)
    return top


def output_max(runner) -> float:
    """The largest finite magnitude among the model's outputs in a forward-only re-run."""
    seen: list[float] = []

    def hook(m, args, out):
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
                a = t.detach().abs()
                seen.append(float(a[torch.isfinite(a)].max()) if torch.isfinite(a).any() else 0.0)

    try:
        runner.run(backward=False, instrument=False,
                   hooks=lambda model: [model.register_forward_hook(outside_transforms(hook))])
    except Exception:  # (a forward that fails alone: no comparison, no claim)
        return math.inf
    finally:
        runner.reset()
    return max(seen, default=math.inf)


def upstream_cause(runner, node: str | None, cause: Cause) -> Cause:
    """``cause`` for a backward overflow at ``node``, said as the loss's gradient scale when
    the gradient entering the model's output was at least :data:`HUGE` and :data:`RATIO`
    times the model's outputs (a coefficient, not outputs that diverged: a squared error's
    gradient is of its prediction's size, and so is a diverging model's)."""
    if (bypassed := past_scaler_cause(runner.step, node, cause)) is not None:
        return bypassed
    if cause.name != "overflow" or (top := entering_max(runner.step)) is None or top < HUGE \
            or top < RATIO * output_max(runner):
        return cause
    op = node or "the backward node"
    return Cause("overflow", f"{op}'s gradient overflowed, but not near a pole of its own: the "
                 f"gradient entering the model's output was already {top:.3g} (recorded), "
                 "orders of magnitude beyond the outputs it is the gradient of, and the "
                 "model's backward, which multiplies it by activations and weights and sums it "
                 "over positions, took it beyond its type's range. The loss computed outside "
                 "the model sends a gradient that large: a coefficient scaling the loss or its "
                 "argument (DPO's beta, a reward scale, a loss weight, 1 / a temperature near "
                 "0) is orders of magnitude too large; reduce it (a wider type only postpones "
                 "the overflow)")


def past_scaler_cause(step, node: str | None, cause: Cause) -> Cause | None:
    """``cause`` for a backward overflow of a step the recorder's GradScaler did not skip:
    the scaled gradients an overflow made non-finite reached ``opt.step()``, which
    ``scaler.step(opt)`` would have skipped; None for another event, without a scaler of a
    scale above 1, or where a non-finite gradient is of a parameter the optimizer (which the
    scaler checks) lacks."""
    scale = scaler_state(step).get("scale")
    ev = step.event
    if cause.name != "overflow" or not isinstance(scale, (int, float)) or not scale > 1 \
            or ev.get("phase") != "backward" or ev.get("reason") != "non_finite":
        return None
    # (the scaler checks the optimizer's gradients only: another one's, no skip to bypass)
    stepped = {n for g in (step.meta.get("optimizer") or {}).get("param_groups") or []
               for n in g.get("params") or []}
    if not ev.get("params") or not set(ev["params"]) <= stepped:
        return None
    op = node or "the backward node"
    return Cause("overflow", f"{op}'s gradient overflowed under the GradScaler's loss scale "
                 f"({scale:g}): by design, the scaler grows its scale until a scaled gradient "
                 "overflows, then scaler.step(optimizer) skips that step and scaler.update() "
                 "lowers the scale (the recorder, given the scaler, raises nothing for a "
                 "skipped step). This step's optimizer.step() ran on the non-finite gradients "
                 "instead: the loop steps the optimizer itself, past the scaler (as after "
                 "scaler.unscale_(optimizer) for clipping). Call scaler.step(optimizer), then "
                 "scaler.update(); no wider type or smaller loss is needed")
