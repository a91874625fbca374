"""The float64 re-run's inputs of the blamed op beside the step's own, where the op went
non-finite: an input 0 in the step whose float64 value is below the smallest normal number of a
type it went through (its own, or a narrower one ops before the op computed in: float16
autocast's sigmoid of a rare class's logit, 0 in float16, summed in float32 into a soft-F1's
denominator; for a loss's op, the type the forward's autocast computed its inputs in: a float16
conv2d's flush of a weak wavefield, carried into float32 traces) is an underflow; else the first input that differs is rounding (precision).
"""

from __future__ import annotations

import torch

from .dispatch import OpAt
from .ops import Evidence


def moved(capture: OpAt | None, ev: Evidence):
    """How the float64 re-run's inputs differ where the op went non-finite: ("underflow", i,
    value) for an input 0 in its type whose float64 value is below :func:`smallest` of a type
    it went through (:func:`made_in`), else ("precision", i, value) for the first input that differs, one 0 in its type first (the
    divisor at a quotient's pole: CROWN's ``u - l`` whose eps rounding lost); None when unknown."""
    if capture is None or capture.inputs is None or len(capture.inputs) != len(ev.inputs):
        return None
    first = pole = None
    for i, (v, t64) in enumerate(zip(ev.inputs, capture.inputs)):
        if not ev.elementwise[i]:
            continue
        try:
            w = torch.broadcast_to(t64.double(), ev.bad.shape)[ev.bad.to(t64.device)].cpu()
        except RuntimeError:
            continue
        tiny = max(smallest(t, t != ev.input_dtypes[i]) for t in made_in(ev, i))
        under = (v == 0) & (w != 0) & (w.abs() < tiny)
        if bool(under.any()):
            return "underflow", i, float(w[under][0])
        differs, at_pole = v != w, (v != w) & (v == 0)
        if first is None and bool(differs.any()):
            first = ("precision", i, float(w[differs][0]))
        if pole is None and bool(at_pole.any()):
            pole = ("precision", i, float(w[at_pole][0]))
    return pole or first


def smallest(dtype: torch.dtype, before: bool) -> float:
    """The edge below which a value is 0 in ``dtype``: its smallest normal number for the op's
    own input type; for a narrower type ops before the op computed in, its smallest subnormal
    (what that type cannot hold at all; a float32 residue above it is rounding, not a flush)."""
    f = torch.finfo(dtype)
    return f.tiny * f.eps if before else f.tiny


def made_in(ev: Evidence, i: int) -> list[torch.dtype]:
    """The types input ``i`` went through: its own, and the narrower type ops before the op
    computed in (float16 autocast's sigmoid whose 0 a float32 sum then carried)."""
    own = ev.input_dtypes[i]
    # (a loss's inputs also went through the forward's autocast type: a float16 conv's 0)
    narrow = min((d for d in (ev.narrowest, ev.given_in) if d is not None),
                 key=lambda d: torch.finfo(d).bits, default=None)
    wider = narrow is None or torch.finfo(narrow).bits >= torch.finfo(own).bits
    return [own] if wider else [own, narrow]
