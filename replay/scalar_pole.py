"""A backward node at its derivative's pole whose saved values are all 0-d: one value for the
whole batch, exactly 0 in this step. DCRNN's masked RMSE, ``sqrt(masked_mse)``, is 0 on a batch
whose every target reading is missing (the guarded mask is all 0): the forward is finite, the
derivative ``1 / (2 sqrt(0))`` is not. "Its input is at the pole, add an eps or skip such
entries" reads as if some rows were bad; no row is, the batch holds nothing to fit."""

from __future__ import annotations

SCALAR_POLE = (
    "{node} made a non-finite gradient from finite incoming gradients, in float64 too: its "
    "input is one 0-d value for the whole batch, exactly 0 in this step (a mean or sum over "
    "no valid element: every target of the batch masked or missing; a loss already 0), the "
    "pole of its derivative: no row is to blame; skip such batches (if mask.sum() == 0) or "
    "keep the value off the pole (torch.sqrt(mse + eps))")


def scalar_at_pole(saved) -> bool:
    """Every floating tensor a node saved (``saved``, None when unknown) is 0-d and one of
    them is exactly 0."""
    saved = saved or []
    return bool(saved) and all(t.dim() == 0 for t in saved) \
        and any(bool(t == 0) for t in saved if not t.is_complex())
