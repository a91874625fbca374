"""A matrix decomposition that failed on a statistic of fewer samples than its dimensions.

DAGMM's mixture covariances of a ``DataLoader``'s last batch (``drop_last=False``: 2 records
left over), a batch covariance of 3 samples of 8 features: such a matrix has rank below its
size, and only the jitter on its diagonal keeps it positive-definite in exact arithmetic. When
float32 cannot hold that jitter beside the matrix's scale, :func:`replay.linalg.judge` says
``precision`` and proposes more jitter; :func:`few_samples_note` adds that the batch is the
reason (the jitter was the matrix's only support), so dropping such batches is the fix.
"""

from __future__ import annotations

import torch


def few_samples_note(matrix32: torch.Tensor, matrix64: torch.Tensor, batch: int | None,
                     spd: bool = True) -> str:
    """A sentence for the hint when the micro-batch of ``batch`` samples is smaller than the
    matrix and as many of the float64 matrix's eigenvalues as its rank deficit needs sit below
    float32's resolution of it (of a batch of matrices, the first that failed: its Cholesky
    factorisation for ``spd`` ops, else its inverse); else ''."""
    n = matrix64.shape[-1]
    if not batch or batch >= n or matrix32 is None or matrix64.shape != matrix32.shape:
        return ""
    m = matrix32.detach().reshape(-1, n, n)
    info = (torch.linalg.cholesky_ex(m) if spd else torch.linalg.inv_ex(m)).info
    first = int(info.nonzero().flatten()[0]) if bool(info.any()) else 0
    a = matrix64.detach().to(torch.float64).reshape(-1, n, n)[first]
    vals = torch.linalg.eigvalsh((a + a.mT) / 2) if spd else torch.linalg.svdvals(a)
    hi = float(vals.abs().max())
    below = int((vals <= n * torch.finfo(torch.float32).eps * hi).sum())
    if below < n - batch + 1:
        return ""
    vals_said = "eigenvalues" if spd else "singular values"
    return (f"; the micro-batch holds {batch} samples, fewer than the matrix's {n} dimensions, "
            f"and {below} of its {vals_said} are below float32's resolution of it (the jitter "
            "at most): a statistic of so few samples is singular but for the jitter (a last "
            "batch smaller than the others: DataLoader(..., drop_last=True), or skip batches "
            "smaller than the dimension)")
