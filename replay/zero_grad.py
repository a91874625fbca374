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


def zero_layers_text(step: Step, divider: str) -> str:
    """Why a gradient is exactly 0: the all-zero weight matrices of the bundle (a layer
    initialised to zero), and the fix, keeping the eps in the norm ``divider`` divides by."""
    zeros = [k.removeprefix("weights/") for k, w in step.tensors.items()
             if k.startswith("weights/") and w.dim() >= 2 and w.numel() and not bool(w.any())]
    if not zeros:
        return " (no gradient reached it: keep the eps in the norm it divides by)"
    shown = ", ".join(zeros[:3]) + (f" (+{len(zeros) - 3} more)" if len(zeros) > 3 else "")
    return (f", and {shown} {'is' if len(zeros) == 1 else 'are'} all 0 in the bundle: a "
            "layer initialised to zero passes no gradient back to the layers before it until "
            f"its own first update; keep the eps in the norm {divider} divides by "
            "(X / (X.norm() + eps)) or skip parameters whose gradient norm is 0")


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
    return (f"the re-run's backward makes the gradient of {names} exactly 0 in every element, "
            "and the loop's own code turned it into NaN in every element between backward and "
            "step(): a division by its norm, which is 0 (0/0: a per-parameter gradient "
            "normalisation g / g.norm() without eps)" + zero_layers_text(step, "the loop"))
