"""A matrix the code regularises with a ridge on its diagonal that is 0 where it failed.

An LMMSE detector inverts ``H^H H + no * I``: the ridge ``no * I`` keeps it invertible for any
channel, unless the noise variance is 0 (a config's ``snr_db = inf``, ``no = 10 ** (-inf /
10)``); a Levenberg-Marquardt damping annealed to 0, a jitter of 0 alike. The matrix is then
singular for a rank-deficient ``H`` (a zero-padded user), and the fault is the ridge's 0, not
the record: :class:`Ridges` remembers the diagonal-only term each ``add`` put on a square
matrix, and :func:`zero_ridge_hint` says so when it is 0 at every failing matrix.
"""

from __future__ import annotations

import torch

from .memo import TensorMarks


class Ridges:
    """The diagonal of the diagonal-only term an ``add`` put on each square matrix it made."""

    def __init__(self):
        self._of = TensorMarks()

    def track(self, name: str, args, out) -> None:
        if name != "add" or not isinstance(out, torch.Tensor) or out.dim() < 2 \
                or out.shape[-1] != out.shape[-2] or len(args) < 2:
            return
        a, b = args[0], args[1]
        if _diagonal_only(b) and not _diagonal_only(a):
            diag = torch.diagonal(b, dim1=-2, dim2=-1).detach()
            self._of.put(out, torch.broadcast_to(diag, out.shape[:-1]))

    def of(self, matrix) -> torch.Tensor | None:
        """The ridge's diagonal of ``matrix`` (``(..., n)``), None when no add made it."""
        return self._of.get(matrix)


def _diagonal_only(t) -> bool:
    if not isinstance(t, torch.Tensor) or t.dim() < 2 or t.shape[-1] != t.shape[-2] \
            or t.shape[-1] < 2:
        return False
    off = t - torch.diag_embed(torch.diagonal(t, dim1=-2, dim2=-1))
    return not bool(off.any())


def zero_ridge_hint(ridge: torch.Tensor | None, rows: list[int]) -> str | None:
    """The remedy for a singular matrix whose ridge is exactly 0 at the failing samples
    ``rows`` (every matrix, for none); None when it is not."""
    if ridge is None or ridge.dim() < 1:
        return None
    at = ridge[rows] if rows and ridge.dim() >= 2 and max(rows) < ridge.shape[0] else ridge
    if at.numel() == 0 or bool(at.any()):
        return None
    which = "at the samples named" if rows else "there"
    return ("the ridge the code adds to its diagonal (A + lam * I: a noise variance, a "
            f"damping, a jitter) is exactly 0 {which}, so it regularised nothing (a noise "
            "variance of 0 from an SNR of inf dB, a damping or jitter annealed or set to 0): "
            "keep it positive (lam.clamp_min(eps)) where the value is made, or leave such "
            "samples out")


def small_ridge_hint(ridge: torch.Tensor | None, matrix: torch.Tensor,
                     rows: list[int]) -> str | None:
    """The remedy for a matrix positive-definite in float64 only whose ridge is positive but
    below the rounding of its dtype at the matrix's scale (a GP likelihood's noise constraint
    lowered to 1e-10 under duplicated inputs: the kernel is singular but for that noise, and
    float32 rounds it away); None when there is no such ridge."""
    if ridge is None or ridge.dim() < 1 or not matrix.is_floating_point():
        return None
    at = ridge[rows] if rows and ridge.dim() >= 2 and max(rows) < ridge.shape[0] else ridge
    if at.numel() == 0 or not bool((at > 0).all()) or not bool(at.isfinite().all()):
        return None
    scale = float(torch.diagonal(matrix.detach(), dim1=-2, dim2=-1).abs().max())
    floor = torch.finfo(matrix.dtype).eps * scale
    top = float(at.max())
    if top >= floor:
        return None
    return (f"the ridge the code adds to its diagonal (A + lam * I: a noise variance, a "
            f"jitter; {top:.3g} here) is below {str(matrix.dtype).removeprefix('torch.')}'s "
            f"rounding at the matrix's scale (eps x its largest diagonal entry, {floor:.3g}), "
            "so it regularised nothing as the matrix was stored; the matrix is singular but "
            "for it (duplicated or near-duplicate rows): keep the ridge above that floor (a "
            "noise constraint's lower bound, a minimum jitter: GPyTorch's default "
            "GreaterThan(1e-4) on a likelihood's noise), drop the duplicated rows, or "
            "decompose in float64")
