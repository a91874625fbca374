"""A matrix a Cholesky refused because it has a clearly negative eigenvalue, in float64 too.

A singular positive semi-definite matrix (a Gram matrix of dependent rows, a covariance of a
dead feature) has its smallest eigenvalue at 0 up to rounding, and a ridge on the diagonal
mends it. An indefinite one is another bug: a Hessian of a non-convex objective, or an
approximation of one, taken where its curvature is negative (iLQR / DDP's
``Q_uu = R + Bᵀ V_xx B`` through a swing-up cost's ``cos θ`` curvature, a Newton step away from a
minimum). A small ridge scaled to the diagonal does not reach its negative eigenvalue and
dropping "dependent rows" means nothing there: the fix is a regularisation larger than that
eigenvalue (Levenberg-Marquardt's ``mu``) or a curvature positive by construction.
"""

from __future__ import annotations

import torch

# an eigenvalue this far below 0, relative to its matrix's largest, is no rounding of a
# singular PSD matrix (which float64 leaves at about n * 1e-16 of it), nor of one whose
# float64 re-run still reads float32 sums a cancellation left near 0 (about 1e-7 of it)
_NEGATIVE = 1e-3


def indefinite_hint(op: str, a64: torch.Tensor, elements: list[int] | None = None
                    ) -> str | None:
    """The hint for a float64 matrix (or batch of them) of which one has an eigenvalue below
    ``-_NEGATIVE`` times its own largest; None for a matrix singular up to rounding.
    ``elements``: the batch elements ``a64``'s matrices are (the failing samples' picked out of
    a batch), None for one matrix given alone."""
    vals = torch.linalg.eigvalsh((a64 + a64.mT) / 2).reshape(-1, a64.shape[-1])
    scale = vals.abs().amax(-1).clamp_min(1e-300)
    rel = vals.amin(-1) / scale
    k = int(rel.argmin())
    if float(rel[k]) >= -_NEGATIVE:
        return None
    if elements is None and vals.shape[0] > 1:
        elements = list(range(vals.shape[0]))
    where = f" of batch element {elements[k]}" if elements else ""
    return (f"aten.{op}: the matrix is indefinite in exact arithmetic too (float64 re-run"
            f"{where}: smallest eigenvalue {float(vals[k].min()):.3g}, largest magnitude "
            f"{float(scale[k]):.3g}), not singular: it has negative curvature, as a Hessian of a "
            "non-convex cost has (iLQR/DDP's Q_uu = R + B^T V_xx B, a Newton step's Hessian "
            "away from a minimum), which a small jitter does not reach: regularise by more than "
            "that eigenvalue (Levenberg-Marquardt: Q_uu + mu * I, mu raised until "
            "torch.linalg.cholesky_ex's info is 0), or make the curvature positive by "
            "construction (a Gauss-Newton approximation, the cost's Hessian clamped at 0, a "
            "matrix built as L L^T)")
