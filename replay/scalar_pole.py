"""A backward node at its derivative's pole whose saved values are all 0-d: one value for the
whole batch, exactly 0 in this step. DCRNN's masked RMSE, ``sqrt(masked_mse)``, is 0 on a batch
whose every target reading is missing (the guarded mask is all 0): the forward is finite, the
derivative ``1 / (2 sqrt(0))`` is not. "Its input is at the pole, add an eps or skip such
entries" reads as if some rows were bad; no row is, the batch holds nothing to fit."""

from __future__ import annotations

import torch

SCALAR_POLE = (
    "{node} made a non-finite gradient from finite incoming gradients, in float64 too: its "
    "input is one 0-d value for the whole batch, exactly 0 in this step (a mean or sum over "
    "no valid element: every target of the batch masked or missing; a loss already 0), the "
    "pole of its derivative: no row is to blame; skip such batches (if mask.sum() == 0) or "
    "keep the value off the pole (torch.sqrt(mse + eps))")


def scalar_at_pole(node, saved) -> bool:
    """Every floating tensor ``node`` saved (``saved``, None when unknown) is 0-d, one of them
    is exactly 0, and that 0 is a masked reduction's: a product with a mask of zeros only
    feeds it (not a distance that is 0 because two values are equal, FedProx's
    ``sqrt(sum((w - w_g) ** 2))`` at ``w == w_g``: its own advice, vector_norm)."""
    saved = saved or []
    return bool(saved) and all(t.dim() == 0 for t in saved) \
        and any(bool(t == 0) for t in saved if not t.is_complex()) and _masked_to_zero(node)


def _masked_to_zero(node, depth: int = 6) -> bool:
    """A ``MulBackward0`` within ``depth`` nodes below ``node`` saved a factor that is 0 at
    every entry and takes no gradient (the mask of a batch with nothing valid; not the
    error ``d`` of a perfect fit in ``d * d``, which the model's output made: a per-series
    RMSE's series forecast exactly)."""
    seen, frontier = set(), [node]
    for _ in range(depth):
        nxt = []
        for n in frontier:
            for f, _ in getattr(n, "next_functions", ()):
                if f is None or f in seen:
                    continue
                seen.add(f)
                if type(f).__name__ == "MulBackward0" and any(
                        isinstance(t, torch.Tensor) and t.numel() > 1 and t.is_floating_point()
                        and not t.requires_grad and not bool(t.any()) for t in _factors(f)):
                    return True
                nxt.append(f)
        frontier = nxt
    return False


def _factors(node) -> list:
    out = []
    for name in ("_saved_self", "_saved_other"):
        try:
            out.append(getattr(node, name))
        except (AttributeError, RuntimeError):  # (not saved, or freed)
            continue
    return out
