"""A log-determinant barrier on the M-matrices: DAGMA's acyclicity ``-logdet(s I - W * W) +
d log s``.

``s I - W * W`` has every off-diagonal entry <= 0 (a Z-matrix), and its determinant is
positive exactly while it is an M-matrix (``s`` above the spectral radius of ``W * W``); the
barrier is defined only there. A negative determinant says the iterate left that domain (a step
too large near its edge, or ``s`` lowered below ``W``'s spectral radius), not a matrix whose
sign does not matter: ``slogdet``'s log-absolute value, the advice for a flow's log-Jacobian,
would train on a meaningless ``h``. The fix is DAGMA's own check on the iterate.
"""

from __future__ import annotations

import torch

ADVICE = ("keep the iterate inside the domain, as DAGMA does: take torch.linalg.slogdet and, "
          "where its sign is not 1 (or h < 0), restore the last W and halve the learning "
          "rate, and lower s (or start an outer round) only while s stays above the spectral "
          "radius of W * W; slogdet's log-absolute value alone would hide the exit and train "
          "on a meaningless h")


def z_matrix(x: torch.Tensor) -> bool:
    """Every matrix of ``x`` (..., n, n) has its off-diagonal entries <= 0, some < 0: the
    form ``s I - A`` of a nonnegative ``A`` that an M-matrix barrier takes."""
    n = x.shape[-1]
    off = x.masked_select(~torch.eye(n, dtype=torch.bool, device=x.device).expand(x.shape))
    return n > 1 and bool((off <= 0).all()) and bool((off < 0).any())


def m_matrix_exit(op: str, det: str) -> tuple[str, str]:
    """What a log-determinant of a Z-matrix with a negative determinant was given, and the
    advice's key."""
    return (f"{op} of a matrix whose determinant is negative ({det}) and whose off-diagonal "
            "entries are all <= 0 (s I - W * W, an M-matrix barrier's): it is no longer an "
            "M-matrix, s is below the spectral radius of its nonnegative part, so the iterate "
            "has left the barrier's domain", "m_matrix")
