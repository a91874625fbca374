"""A float64 divisor (or a log's input) that is itself rounding residue, not a value.

The float64 re-run "fixes" a 0/0 whenever the divisor float32 rounded to 0 is non-zero in
float64; that is ``precision`` only when float64 holds the true value. A divisor that exact
arithmetic makes 0 (a median of pairwise distances over a batch repeating one sample, taken
through cdist's ``|x|² + |y|² - 2 x·y``) comes out of float64 as a residue of the same
cancellation, some ulps of the values it was made from: finite, and as wrong. Such a float64
divisor is within a few float64 epsilons of the numerator's scale (the values divided, in the
same units as the divisor they are measured against), where any true one sits far above.
"""

from __future__ import annotations

import torch

from . import saturation
from .dispatch import OpAt
from .domains import g
from .hits import Evidence

_ULPS = 64  # how many float64 epsilons of the numerator's scale still read as residue


# Ops with a pole at 0 of their one input, whose float64 input may be such a residue too: the
# log of a spectrum's magnitude at a bin that exact arithmetic makes 0 (a codec's reconstruction
# of a silent clip, periodic, through ``torch.stft(...).abs()``), which float64 leaves at some
# ulps of the spectrum's largest bin
_POLES = {"log", "log2", "log10", "reciprocal", "rsqrt"}


def divisor_residue(name: str, capture: OpAt | None, ev: Evidence) -> float | None:
    """The float64 divisor of division ``name`` (or the input of a log, a reciprocal: its
    pole) where it was 0 in its own type, when every such float64 value is within ``_ULPS``
    epsilons of the numerator's largest magnitude (the input's own, for those) — so exact
    arithmetic would make it 0 too; else None."""
    op = name.rstrip("_")
    i = 1 if op == "div" else 0 if op in _POLES else None
    if i is None or capture is None or capture.inputs is None \
            or len(capture.inputs) <= i or len(ev.inputs) <= i or not ev.elementwise[i]:
        return None
    num64, den64 = capture.inputs[0], capture.inputs[i]
    if not all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in (num64, den64)):
        return None
    try:
        w = torch.broadcast_to(den64.double(), ev.bad.shape)[ev.bad.to(den64.device)].cpu()
    except RuntimeError:
        return None
    v = ev.inputs[i]  # (taken at ``bad`` too)
    if v.shape != w.shape:
        return None
    moved = (v == 0) & (w != 0)
    if not bool(moved.any()) or not num64.numel():
        return None
    if i == 0:  # (each against its own row's largest: a quiet clip beside loud ones is no residue)
        x = torch.broadcast_to(num64.double().abs(), ev.bad.shape)
        scale = x.flatten(1).amax(1, keepdim=True).expand_as(x.flatten(1)).reshape(x.shape) \
            if x.dim() > 1 else x.amax().expand_as(x)
        scale = scale[ev.bad.to(x.device)].cpu()[moved]
    else:
        scale = num64.double().abs().max().cpu()
    limit = _ULPS * torch.finfo(torch.float64).eps * scale
    return float(w[moved][0]) if bool((w[moved].abs() <= limit).all()) \
        and bool((limit > 0).all()) else None


def hint(name: str, capture: OpAt | None, ev: Evidence, what: str, advice: str) -> str | None:
    """The ``invalid`` hint for a division whose float64 divisor is such a residue, else None.
    (``what``: the op and what it was given; ``advice``: the division's.)"""
    # (1 - tanh(u)² of a saturated tanh: exact arithmetic keeps it above 0, so float64's small
    # value is the true one however large the numerator: precision, replay.saturation's)
    if saturation.rounded_zero(ev.inputs, ev.complement):
        return None
    left = divisor_residue(name, capture, ev)
    if left is None:
        return None
    of = "values divided" if name.rstrip("_") == "div" else "largest value it was given"
    return (f"{what}, which exact arithmetic makes too: float64's {g(left)} there is a "
            f"rounding residue (within float64's precision of the {of}), not a "
            f"value, so float64 is no fix: {advice}")
