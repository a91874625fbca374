"""A matrix a distribution refused as not positive-definite (``MultivariateNormal``'s
``covariance_matrix`` or ``precision_matrix``, a ``Wishart``'s), judged as a matrix.

The refusal's check marks whole matrices, so its "values refused" are every entry of the
matrix, off-diagonal ones and negative ones included, and the usual advice (a scale through
softplus) says nothing of a covariance. A batch covariance of embeddings with a unit a ReLU
left at 0 over the batch (a dead feature), a constant or duplicated dimension, or fewer
samples than dimensions is singular: its eigenvalues in the float64 re-run say so, and its
rows of zeros name the dimensions.
"""

from __future__ import annotations

import torch

_MATRIX_CONSTRAINTS = ("PositiveDefinite", "PositiveSemidefinite")


def is_matrix_refusal(constraint: str, value) -> bool:
    return constraint.startswith(_MATRIX_CONSTRAINTS) and isinstance(value, torch.Tensor) \
        and value.dim() >= 2 and value.shape[-1] == value.shape[-2]


def matrix_judge(refused: str, value64: torch.Tensor, valid64) -> tuple[str, str]:
    """``invalid``, and what the float64 re-run's refused matrix (the first of a batch that
    failed) is: its eigenvalues and its zero rows."""
    a = value64.detach().to(torch.float64).reshape(-1, *value64.shape[-2:])
    bad = (~valid64.reshape(a.shape[0], -1).all(1)).nonzero().flatten() \
        if isinstance(valid64, torch.Tensor) else torch.zeros(1, dtype=torch.long)
    m = a[int(bad[0]) if bad.numel() else 0]
    n = m.shape[-1]
    vals = torch.linalg.eigvalsh((m + m.mT) / 2)
    lo, hi = float(vals.min()), float(vals.abs().max())
    tol = n * torch.finfo(torch.float64).eps * max(hi, 1e-300)
    at_zero = int((vals <= tol).sum())
    zero_rows = (m == 0).all(1).nonzero().flatten().tolist()
    rows = (f"; row and column {', '.join(map(str, zero_rows))} of it are exactly 0 (a feature "
            "constant over the batch: a unit a ReLU left at 0 for every sample, a dead or "
            "constant input)" if zero_rows else "")
    return "invalid", (
        f"{refused}: the matrix is not positive-definite in float64 too (smallest eigenvalue "
        f"{lo:.3g}, largest {hi:.3g}, {at_zero} of {n} at 0 within rounding){rows}: its rows "
        "are linearly dependent (a dead or constant feature, duplicated dimensions, fewer "
        "samples than dimensions); add a ridge to the diagonal (cov + eps * I, eps scaled to "
        "cov.diagonal().mean()) or drop the dependent dimensions")


def cholesky_diagonal(constraint: str, value, valid, bad):
    """Of a Cholesky factor refused (``LowerCholesky``: lower-triangular with a positive
    diagonal), the diagonal entries at or below 0, which are what it refused (the check marks
    whole matrices, the upper triangle's zeros and the finite entries included, so the 0s
    an underflowed softplus or exp left on the diagonal read as a mix of 0 and 109, judged
    ``precision``); ``bad`` as it is otherwise."""
    if not constraint.startswith(("LowerCholesky", "CorrCholesky")) or value is None \
            or value.dim() < 2 or value.shape[-1] != value.shape[-2]:
        return bad
    diag = value.detach().diagonal(dim1=-2, dim2=-1)
    refused = ~valid[..., 0, 0]
    low = diag[refused][diag[refused] <= 0]
    return low if low.numel() else bad
