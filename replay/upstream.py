"""What the ops the op finder watched before the blamed op add to its cause:

- ``precision`` at an op wider than ops before it (a kernel matrix ``f @ f.T`` that bfloat16
  autocast computed, cast to float32 for a Cholesky): its inputs carry the narrow type's
  rounding, which the float64 re-run, without autocast, does not make;
- ``overflow`` at a call of an op whose earlier calls in the same watched code grew
  call after call (a Newton-Schulz iteration for a matrix square root, run on a matrix not
  scaled to converge; an unrolled solver or recurrence written as a loop in one forward): the
  iterates were diverging, which a wider type only postpones (as :mod:`replay.recurrence`
  says of a module called again and again).
"""

from __future__ import annotations

import math
import statistics

import torch

from . import batch_overflow, clamped_divisor, data_factor, lost_eps, xlogx
from .cause_text import DO, MASK_AFTER_POLE
from .fill_overflow import is_fill
from .hits import Evidence

MIN_CALLS = 8  # earlier finite calls of the op: fewer is no loop
GROWTH = 100.0  # its last finite call's largest magnitude over the median of those calls
STEADY = 0.5  # the least share of its calls no smaller than the one before
# an overflow whose every infinity a mask's 0 then met: the entries the mask drops overflowed
MASK_AFTER_OVERFLOW = (
    "; then {op} multiplied every infinity it made by a mask's 0, and inf * 0 is NaN: the "
    "entries that overflowed are the ones the mask drops (a causal mask multiplied in after "
    "exp((i - j) * log gamma), whose entries above the diagonal grow with the length), so "
    "no rescaling is needed: apply the mask to the op's input instead (fill it with -inf "
    "where the mask is 0, so exp gives exactly 0 there, as RetNet's decay mask and Mamba-2's "
    "segsum do)")


def context(cause: str | None, ev: Evidence | None, cast: torch.dtype | None) -> str:
    """The hint's addition for ``cause`` given the op's evidence (``""`` when none)."""
    if ev is None:
        return ""
    masked = MASK_AFTER_POLE.format(op=ev.masked_after) \
        if ev.masked_after and cause == "invalid" else ""
    if lost := lost_eps.context(ev):  # (1e-8 added in float16: whatever the cause)
        return lost + (masked if lost_eps.zero(ev) else "")  # (an eps of 0: the mask too)
    if masked:
        return masked
    if cause == "invalid" and ev.data_divisor:
        return ev.data_divisor  # (data_divisor's, or positive_counts' for a count of 1s)
    if cause == "invalid" and ev.data_factor:
        return data_factor.ADVICE
    if cause == "invalid" and ev.cut_divisor:
        return clamped_divisor.ADVICE
    if cause == "invalid" and (own := xlogx.context(ev)):
        return own
    if cause == "invalid" and ev.zero_operand:
        return ev.zero_operand
    if cause == "precision":
        return _narrower(ev, cast)
    if cause == "overflow":
        return MASK_AFTER_OVERFLOW.format(op=ev.masked_after) if ev.masked_after \
            else _diverging(ev) or (batch_overflow.ADVICE if ev.of_data or ev.unlearned else "")
    return ""


def _type(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _narrower(ev: Evidence, cast: torch.dtype | None) -> str:
    narrow = ev.narrowest
    if narrow is None or torch.finfo(narrow).bits >= torch.finfo(ev.dtype).bits:
        return ""
    bits = 1 - int(math.log2(torch.finfo(narrow).eps))
    under = f" (the step ran under {_type(cast)} autocast)" if cast == narrow else ""
    return (f"; but ops before it computed in {_type(narrow)}{under}, which keeps {bits} "
            f"significant bits: its inputs may carry that rounding, far coarser than "
            f"{_type(ev.dtype)}'s: " + DO["autocast_precision"])


def diverging(sizes: list[float]) -> tuple[float, float] | None:
    """``(median, last)`` of an op's earlier calls' largest magnitudes when there are at
    least :data:`MIN_CALLS`, the last is the largest and :data:`GROWTH` times their median or
    more, and they rose from one call to the next at least :data:`STEADY` of the time."""
    if len(sizes) < MIN_CALLS:
        return None
    mid, last = statistics.median(sizes), sizes[-1]
    if mid <= 0 or last < GROWTH * mid or last < max(sizes):
        return None
    rising = sum(b >= a for a, b in zip(sizes, sizes[1:]))
    return (mid, last) if rising >= STEADY * (len(sizes) - 1) else None


_GREW = ("; but the op's {n} earlier calls here grew from a median of {mid:.3g} to {last:.3g}, "
         "call after call: the iterates of a loop were diverging, which a wider type only "
         "postpones: ")


def _diverging(ev: Evidence) -> str:
    grew = diverging(ev.sizes)
    if grew is None or is_fill(grew[1], ev.dtype):  # (a mask's -finfo.max: no iterate)
        return ""
    return _GREW.format(n=len(ev.sizes), mid=grew[0], last=grew[1]) + DO["iteration"]


def without_diverging(hint: str) -> str:
    """``hint`` without :func:`_diverging`'s sentence, where a finding explains the growth
    (a hand-written log-sum-exp over a sequence's time steps)."""
    head = _GREW.split("{n}")[0]
    start = hint.find(head)
    end = hint.find(DO["iteration"], start)
    if start < 0 or end < 0:
        return hint
    return hint[:start] + hint[end + len(DO["iteration"]):]
