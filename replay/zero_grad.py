"""A parameter whose whole gradient was exactly 0 where its update left an op's domain.

Muon's ``X / X.norm()`` (an eps dropped from Newton-Schulz's normalisation), normalised SGD's
``g / ||g||`` and LARS's trust ratio divide by a norm of the gradient or update, 0 only when
every element is. That has a cause upstream the hint can name: a layer after it initialised to
zero (modded-nanogpt's ``c_proj.weight.zero_()``, a zero-init residual branch) passes no
gradient back until its own first update, so the layers before it get a gradient of exactly 0
at step 0. A ``guard_optimizer`` bundle holds the gradients and weights the update started
from, which show both.
"""

from __future__ import annotations

import torch

from .load import Step


def zero_gradient_text(step: Step, params: list[str], at) -> str:
    """``; NAME's gradient was exactly 0 in every element ...`` (with the all-zero weights
    of the bundle, when any), or ``""`` when its gradient is not all 0 or not in the bundle."""
    if not params or step.meta.get("state") == "after_update":
        return ""  # (its gradients may be a later step's: the update's are gone)
    g = step.tensors.get(f"grads/{params[0]}")
    if g is None or not g.numel() or not g.is_floating_point() or bool(g.any()):
        return ""
    text = f"; {params[0]}'s gradient was exactly 0 in every element at step {at}"
    return text + zero_layers_text(step, "the update")


def zero_layers_text(step: Step, divider: str, fix: bool = True) -> str:
    """Why a gradient is exactly 0: the all-zero weight matrices of the bundle (a layer
    initialised to zero), and (``fix``) the fix, keeping the eps in the norm ``divider``
    divides by."""
    zeros = [k.removeprefix("weights/") for k, w in step.tensors.items()
             if k.startswith("weights/") and w.dim() >= 2 and w.numel() and not bool(w.any())]
    if not zeros:
        return " (no gradient reached it: keep the eps in the norm it divides by)" if fix else ""
    shown = ", ".join(zeros[:3]) + (f" (+{len(zeros) - 3} more)" if len(zeros) > 3 else "")
    return (f", and {shown} {'is' if len(zeros) == 1 else 'are'} all 0 in the bundle: a "
            "layer initialised to zero passes no gradient back to the layers before it until "
            "its own first update" + (f"; keep the eps in the norm {divider} divides by "
            "(X / (X.norm() + eps)) or skip parameters whose gradient norm is 0" if fix else ""))


def normalised_zero_gradient(step: Step, runner, params: list[str]) -> str:
    """The hint for gradients the loop's own code made NaN in every element where the re-run's
    backward makes them exactly 0 in every element: the loop divided each by its norm (the
    per-parameter normalisation ``g / g.norm()`` of neural cellular automata, normalised SGD)
    without eps, 0/0; ``""`` otherwise."""
    recorded = step.tensors.get(f"grads/{params[0]}") if params and runner is not None else None
    if recorded is None or not recorded.numel() or not bool(torch.isnan(recorded).all()):
        return ""  # (a norm of 0 divides every element: a NaN in some only is another bug)
    runner.run(instrument=False)
    grads = {n: p.grad for n, p in runner.model.named_parameters()}
    zero = [n for n in params if n in grads and (grads[n] is None or not bool(grads[n].any()))]
    if params[0] not in zero:
        return ""
    names = ", ".join(zero)
    if ratio := weight_ratio_text(step, grads, zero):
        return f"the re-run's backward makes the gradient of {names} exactly 0 " + ratio
    return (f"the re-run's backward makes the gradient of {names} exactly 0 in every element, "
            "and the loop's own code turned it into NaN in every element between backward and "
            "step(): a division by its norm, which is 0 (0/0: a per-parameter gradient "
            "normalisation g / g.norm() without eps)" + zero_layers_text(step, "the loop"))


def _shown(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")


def weight_ratio_text(step: Step, grads: dict, zero: list[str]) -> str:
    """The loop's 0/0 was a ratio of a weight norm to a gradient norm (adaptive gradient
    clipping's ``max(|W|, eps) / max(|G|, eps)``, LARS's trust ratio) when the gradients it
    made NaN are exactly those whose weights are all 0 too, while a parameter whose gradient
    the re-run makes 0 but whose weights are not kept a finite one; ``""`` otherwise."""
    def weights(n):
        return step.tensors.get(f"weights/{n}")
    if not zero or any(weights(n) is None or bool(weights(n).any()) for n in zero):
        return ""
    spared = [n for n, g in grads.items() if n not in zero and g is not None
              and not bool(g.any()) and weights(n) is not None and bool(weights(n).any())
              and (r := step.tensors.get(f"grads/{n}")) is not None
              and bool(torch.isfinite(r).all())]
    if not spared:
        return ""
    return ("in every element, and the loop's own code turned it into NaN between backward "
            "and step() in exactly the parameters whose weights are all 0 as well, while "
            f"{_shown(spared)}, whose gradient is 0 too but whose weights are not, kept a "
            "finite one: the loop divided a norm of the weights by the gradient's norm, 0/0 "
            "where both are 0 (adaptive gradient clipping's max(|W|, eps) / max(|G|, eps) "
            "with eps = 0, LARS's or LAMB's trust ratio |W| / |G|); keep eps > 0 in both "
            "clamps (timm's adaptive_clip_grad: |W|.clamp(min=1e-3), |G|.clamp(min=1e-6)) "
            "or skip parameters whose weight norm is 0"
            + zero_layers_text(step, "the loop", fix=False))
