"""A 0 of the batch's data at an op's pole that the data reaches in its ordinary spread.

A diffusion or flow-matching time ``t ~ U[0, 1]`` embedded as ``1 / t`` or ``sqrt(t)`` (whose
derivative ``1 / (2 sqrt t)`` is inf at 0): ``t = 0`` is a legal draw, and the other samples'
values run down close to it. Calling that sample a bad or blank record ("fix or filter it where
the data is made") sends the user to a dataset with nothing wrong in it; the fix is the op's:
a floor on its input or an eps inside it. A price or a focal length of 0 among values far from
0 is still a bad record. Told apart on the recorded values, per entry: 0 lies among the other
samples' values at the same position (their signs differ), or no farther from the nearest of
them than four mean gaps between two of them (a uniform draw's minimum is within four with
probability 1 - e^-4); a price or an amount whose smallest value in a batch of 32 is tens of
such gaps above 0 is not. Only over 16 or more other samples: fewer tell neither apart.
"""

from __future__ import annotations

import torch

__all__ = ["legal_zero", "legal_zero_text"]

# how many other samples' values a spread is judged on: in a batch of 8, a price table's
# smallest value sits as near 0, in mean gaps, as a uniform time's does
_ENOUGH = 16


def _within(others: torch.Tensor) -> tuple[float, float, float] | None:
    """(nearest to 0, lowest, highest) of ``others`` when 0 lies within their spread."""
    v = others[torch.isfinite(others)].double()
    if v.numel() < _ENOUGH:  # (a handful of values says nothing of where the data runs)
        return None
    lo, hi = float(v.min()), float(v.max())
    if lo < 0 < hi:
        return float(v.abs().min()), lo, hi
    nearest = float(v.abs().min())
    spacing = (hi - lo) / (v.numel() - 1)  # (the mean gap between two sorted values)
    return (nearest, lo, hi) if 0 < nearest <= 4 * spacing else None


def legal_zero(t: torch.Tensor, at_zero: torch.Tensor, d: int = 0
               ) -> tuple[float, float, float] | None:
    """(nearest, lowest, highest) of the other samples' values when every entry of ``t``
    (samples along ``d``) at ``at_zero`` (a 0 the op went non-finite at) lies within the
    spread of the other samples' values at that position; else None."""
    if not t.is_floating_point() or t.dim() == 0 or at_zero.shape != t.shape \
            or not bool(at_zero.any()):
        return None
    n = t.shape[d]
    vals = t.detach().movedim(d, 0).reshape(n, -1)
    zero = at_zero.movedim(d, 0).reshape(n, -1)
    found = []
    for col in zero.any(0).nonzero().flatten()[:16].tolist():
        seen = _within(vals[~zero[:, col], col])
        if seen is None:
            return None
        found.append(seen)
    return min(f[0] for f in found), min(f[1] for f in found), max(f[2] for f in found)


def legal_zero_text(name: str, spread: tuple[float, float, float]) -> str:
    """What to say of ``name``'s 0 that lies within the data's spread (:func:`legal_zero`)."""
    nearest, lo, hi = spread
    return (f"{name} is 0 there, a value inside the range the batch's other samples span "
            f"(from {lo:.3g} to {hi:.3g}, the nearest to 0 at {nearest:.3g}): a legal draw "
            "(a time t ~ U[0, 1] at 0, a noise level at its end), not a broken record, so "
            "make the op safe at that value: floor its input (t.clamp_min(1e-5)) or put an "
            "eps inside it (torch.sqrt(t + eps), 1 / (t + eps)), or draw the value from a "
            "range without the pole (t = eps + (1 - eps) * torch.rand(n))")
