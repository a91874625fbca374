"""An update that applied gradients still multiplied by the GradScaler's loss scale.

Under AMP the loop must step through the scaler, ``scaler.step(opt)`` (or call
``scaler.unscale_(opt)`` before ``opt.step()``): a plain ``opt.step()`` hands SGD the scaled
gradients, 65536 times too large, and the weights jump by ``scale * lr * |g|`` in one update.
The recorder reads the gradient norm unscaled, so the step's record says what the update
should have taken. The optimizer state the update wrote (SGD's momentum buffer, the gradient
itself at its first step) or, without any, the weights' jump, is as many times that norm as the
scale: the hint names the missing unscale instead of a learning rate too high.
"""

from __future__ import annotations

import math

import torch

from .recorded import scaler_state

# a ratio this close to the scale (a factor of 16 either way) is the scale, not a momentum's
# sum over steps (at most 1 / (1 - momentum): 10 for 0.9) or gradients that shrank
_NEAR = 16.0
_LEAST_SCALE = 256.0


def unscaled_update_advice(step) -> str | None:
    """The advice when the update before the event step took the GradScaler's scaled
    gradients; None when no scaler scaled them, or the numbers do not say so."""
    scale, before = _scale(step), _previous(step)
    if scale is None or before is None:
        return None
    grad, param, lr = before
    if not grad > 0 or not math.isfinite(grad):
        return None
    bufs = [t for k, t in step.tensors.items()
            if k.startswith("optim/") and k.endswith("/momentum_buffer")]
    if bufs:
        ratio = _norm(bufs) / grad
    else:
        weights = [t for k, t in step.tensors.items() if k.startswith("weights/")]
        if not weights or not lr or not math.isfinite(param):
            return None
        ratio = (_norm(weights) - param) / (lr * grad)
    if not scale / _NEAR <= ratio <= scale * _NEAR:
        return None
    return (f"the update before this step took gradients {ratio:.3g}x the norm the recorder "
            f"read for them ({grad:.3g}), the GradScaler's scale {scale:.6g}: opt.step() was "
            "called on the scaled gradients. Step through the scaler, scaler.step(opt) then "
            "scaler.update() (or scaler.unscale_(opt) before clipping and opt.step()); the "
            "learning rate is not the fault")


def _scale(step) -> float | None:
    scale = scaler_state(step).get("scale")
    if not isinstance(scale, (int, float)) or not scale >= _LEAST_SCALE:
        return None
    return float(scale)


def _previous(step) -> tuple[float, float, float] | None:
    """The ring's gradient norm, weight norm and learning rate of the step before the event
    step (the update that made the event step's weights)."""
    steps, at = step.tensors.get("ring/steps"), step.event.get("step")
    if steps is None or at is None:
        return None
    rows = (steps == at - 1).nonzero().flatten().tolist()
    if not rows:
        return None
    i = rows[-1]

    def read(name):  # (the rate per group: one value when every group has it)
        t = step.tensors.get(f"ring/{name}")
        if t is None or not t.dim() or i >= len(t) or not t[i].numel():
            return math.nan
        row = t[i].flatten()
        return float(row[0]) if bool((row == row[0]).all()) else math.nan
    return read("grad_norm"), read("param_norm"), read("lr")


def _norm(ts: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.detach().double().pow(2).sum()) for t in ts))
