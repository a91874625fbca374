"""A log-determinant of a matrix with two equal rows (or columns): singular by construction.

A Slater determinant (FermiNet, PauliNet) has one row per electron; two electrons of the same
spin at the same point give two equal rows, so ``slogdet``'s log|det| is -inf there whatever
the weights: the wavefunction's node, not an ill-conditioned matrix. Jitter on a diagonal is
the wrong advice; the fix is in what put two particles (records, points) at the same place.
"""

from __future__ import annotations

import math

import torch

ADVICE = ("two of its rows (or columns) are equal, so it is singular whatever the weights: "
          "the rows come from inputs that are equal there (two same-spin electrons at one "
          "point in a Slater determinant, a repeated point or record in a kernel matrix): "
          "find what put them at the same place (a walker reset or initialisation without "
          "spread, a duplicated record) and spread or drop them, or handle a matrix that "
          "vanishes by design (a node of the wavefunction) before the log")


def equal_pair(x: torch.Tensor) -> tuple[int, int] | None:
    """Two row indices of the first matrix in the batch ``x`` (``(..., n, n)``, the singular
    ones) whose rows, or else columns, are exactly equal; None when no such pair exists."""
    first = x.reshape(-1, *x.shape[-2:])[:1]  # (one matrix: n x n distances, not n^3)
    for m in (first, first.transpose(-1, -2)):
        # (exact differences: the matmul form's rounding may leave equal rows apart)
        same = torch.cdist(m, m, compute_mode="donot_use_mm_for_euclid_dist")[0] == 0
        same = same & ~torch.eye(m.shape[-1], dtype=torch.bool, device=m.device)
        hits = same.nonzero()
        if len(hits):
            i, j = hits[0].tolist()
            return i, j
    return None


def as_matrices(x: torch.Tensor, out_shape: torch.Size) -> torch.Tensor | None:
    """A log-determinant's input the evidence keeps flattened, as its ``(..., n, n)``
    matrices: the output has one value per matrix (``out_shape``); None when it does not fit."""
    if x.dim() >= 2 or not len(out_shape):
        return x if x.dim() >= 2 else None
    n = math.isqrt(x.numel() // max(math.prod(out_shape), 1))
    return x.reshape(*out_shape, n, n) if n * n * math.prod(out_shape) == x.numel() else None


def equal_rows_text(op: str, x: torch.Tensor, bad: torch.Tensor) -> tuple[str, str] | None:
    """The situation of a log-determinant whose singular matrices (where ``bad``, a mask over
    its output) have two equal rows; else None."""
    m = as_matrices(x, bad.shape)
    if m is None or m.shape[:-2] != bad.shape or not bool(bad.any()):
        return None
    pair = equal_pair(m[bad])
    if pair is None:
        return None
    return (f"{op} of a singular matrix (determinant 0, whose log is -inf) with two equal "
            f"rows or columns ({pair[0]} and {pair[1]})", "equal_rows")
