"""How a window re-run (``replay.window``) scales its loss and gradients: the GradScaler's
scale, and the factor the loop multiplied its loss by before ``backward()`` (gradient
accumulation's ``loss / k``). The recorder keeps the gradient that entered the model's
outputs, which holds both; a what-if backward starts from the re-run loss instead, and without
the loop's factor its gradients were k times training's: a try that changed nothing went
non-finite steps before the recorded event.
"""

from __future__ import annotations

import math
import statistics

import torch

# (squared) relative residual of recorded = factor x re-run gradients below which the loop's
# loss is the loss function's times one number (rounding in float16 outputs stays far below)
FIT = 1e-4


def loss_factor(loss, pairs: list[tuple[torch.Tensor, torch.Tensor]],
                scale: float | None) -> float | None:
    """The number the loop multiplied ``loss`` by, from the recorded output gradients
    (``pairs``: output, recorded gradient) over the re-run loss's, less the GradScaler's
    ``scale`` they hold too; None when the loss is not a scalar of the graph or the recorded
    gradients are not one multiple of the loss's (the loop added another term)."""
    if not isinstance(loss, torch.Tensor) or not loss.requires_grad or loss.numel() != 1:
        return None
    outs = [o for o, _ in pairs]
    got = torch.autograd.grad(loss, outs, retain_graph=True, allow_unused=True)
    both = [(g.double(), r.double()) for g, (_, r) in zip(got, pairs) if g is not None]
    num = sum(float((g * r).sum()) for g, r in both)
    den = sum(float((g * g).sum()) for g, _ in both)
    rec = sum(float((r * r).sum()) for _, r in both)
    if not both or not den > 0 or not rec > 0 or not math.isfinite(num / den):
        return None
    k = num / den
    resid = sum(float(((r - k * g) ** 2).sum()) for g, r in both) / rec
    return k / scale if resid < FIT and scale else k if resid < FIT else None


def window_factors(factors: dict[int, list[float]]) -> list[float] | None:
    """The loop's factor on the loss of each micro-batch index of a step, over a re-run's steps
    (the median: a last, smaller accumulation batch may differ; 1 where none was measured),
    None when every one is 1."""
    out = [statistics.median(factors[i]) if factors.get(i) else 1.0
           for i in range(max(factors, default=-1) + 1)]
    return out if any(abs(k - 1.0) >= 1e-3 for k in out) else None


def with_factors(mbs: list[dict], factors: list[float] | None) -> list[dict]:
    """A what-if's micro-batches: without the recorded output gradients (the recorded run's,
    its backward starts from its own loss), with the loop's factor on their loss."""
    mbs = [{k: v for k, v in mb.items() if k != "output_grads"} for mb in mbs]
    for i, mb in enumerate(mbs):
        if factors and i < len(factors) and factors[i] != 1.0:
            mb["loss_factor"] = factors[i]
    return mbs


def unscale(model, scale: float) -> None:
    # as GradScaler.unscale_: multiply by the float32 reciprocal of the (float64) scale
    inv = float(torch.tensor(scale, dtype=torch.float64).reciprocal().float())
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(inv)
