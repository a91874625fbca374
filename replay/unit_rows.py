"""Weights the loop wrote non-finite in whole rows while every other row has one L2 norm: a
row normalisation (``w / w.norm(dim=1, keepdim=True)``) of rows that were all 0.

A cosine classifier, a prototype layer or a NormFace / ArcFace head keeps its weight rows at
unit length with a handler the loop runs after each update (Ignite's ``ITERATION_COMPLETED``,
a ``no_grad`` block after ``optimizer.step()``). A row that is 0 by then — pruned, zero
initialised for a class not seen yet, zeroed by a dead-unit reset — is divided by its norm 0:
0/0 in every element of that row and nowhere else. The bundle holds the weights as the loop
left them, so the sign is in them: the finite rows' norms all equal (to float rounding) and the
bad rows NaN throughout. The same weights come from normalising rows already NaN (k-means
centroids ``F.normalize(sums / counts)`` with an empty cluster, a class's imprinted mean over
no samples), so the words name both: the norm's divisor needs an eps (``F.normalize``), or
the value normalised its own guard (said by the hint before these words).
"""

from __future__ import annotations

import torch

MIN_FINITE_ROWS = 2  # one finite row always has "one norm"
RTOL = 1e-4  # the finite rows' norms agree to float32 rounding, not to chance


def unit_rows_text(name: str, t: torch.Tensor) -> str | None:
    """The hint's words when ``t`` (2-D or more, rows along dim 0) is NaN throughout in some
    rows, finite in MIN_FINITE_ROWS or more others whose L2 norms are all one value; else
    None."""
    if t.dim() < 2 or not t.is_floating_point() or t.shape[0] < MIN_FINITE_ROWS + 1:
        return None
    rows = t.detach().reshape(t.shape[0], -1).double()
    nan_rows = torch.isnan(rows).all(1)
    finite_rows = torch.isfinite(rows).all(1)
    if not nan_rows.any() or int(finite_rows.sum()) < MIN_FINITE_ROWS \
            or bool((~nan_rows & ~finite_rows).any()):
        return None
    norms = rows[finite_rows].norm(dim=1)
    c = float(norms.mean())
    if c <= 0 or float((norms - c).abs().max()) > RTOL * c:
        return None
    bad = nan_rows.nonzero().flatten().tolist()
    shown = ", ".join(map(str, bad[:8])) + (f" (+{len(bad) - 8})" if len(bad) > 8 else "")
    return (f"row(s) {shown} of {name} are NaN throughout and every other row has L2 norm "
            f"{c:.4g}: the loop normalises {name}'s rows (w / w.norm(dim=1, keepdim=True): a "
            "cosine or prototype head's constraint, a handler run after each update), so "
            "either these rows were all 0 there (pruned, zero-initialised, reset) and were "
            "divided by a norm of 0, 0/0: divide by norm.clamp_min(eps) (F.normalize(w, "
            "dim=1)) or leave zero rows out of it; or what it normalised was NaN already")
