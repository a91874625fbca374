"""The matrices of a batch a decomposition failed on, judged by the failing samples' own.

A batch of per-sample matrices (ALS's normal equations ``Y^T diag(m_u) Y + reg`` per user, a
per-sample covariance) fails at the samples whose matrix is singular; the spectrum of the whole
batch mixes in the healthy samples' (its largest singular value is another sample's), so the
failing samples' matrices alone are measured. A failing sample whose matrix is exactly 0 in
float64 too had nothing in it (a user with no ratings, an empty document): every term the code
sums over the sample's observations is absent, a ridge scaled by the sample's own count
(ALS-WR's ``lambda * n_u``) with them, and no solver can recover a value from 0 = 0.
"""

from __future__ import annotations

import torch


def failed_matrices(a: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The matrices of the samples ``rows`` of a batch ``a`` (B, n, n); ``a`` when it is one
    matrix, or the rows are not its batch's."""
    if rows and a.dim() == 3 and max(rows) < a.shape[0]:
        return a[rows]
    return a


def all_zero_hint(op: str, a: torch.Tensor, rows: list[int]) -> str | None:
    """The hint for failing samples ``rows`` whose float64 matrices ``a`` are all 0."""
    if not rows or a.numel() == 0 or bool(a.any()):
        return None
    which = f"sample {rows[0]}" if len(rows) == 1 else f"samples {rows}"
    return (f"aten.{op}: the matrix of {which} is all zeros, in float64 too: the sample had "
            "nothing to sum over (a user with no ratings, an item no one rated, an empty "
            "document or mask), so a ridge that scales with its own count of observations "
            "(lambda * n_u, ALS-WR's weighted regularisation) is 0 there as well: add a "
            "ridge that stays positive (lambda * max(n_u, 1), A + eps * I), or leave the "
            "samples with no observations out of the solve (their factor 0 or the prior mean)")
