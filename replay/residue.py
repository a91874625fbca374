"""A float64 divisor that is itself rounding residue, not a value.

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

from .dispatch import OpAt
from .domains import g
from .hits import Evidence

_ULPS = 64  # how many float64 epsilons of the numerator's scale still read as residue


def divisor_residue(name: str, capture: OpAt | None, ev: Evidence) -> float | None:
    """The float64 divisor of division ``name`` where it was 0 in its own type, when every such
    float64 value is within ``_ULPS`` epsilons of the numerator's largest magnitude (so exact
    arithmetic would make it 0 too); else None."""
    if name.rstrip("_") != "div" or capture is None or capture.inputs is None \
            or len(capture.inputs) < 2 or len(ev.inputs) < 2 or not ev.elementwise[1]:
        return None
    num64, den64 = capture.inputs[0], capture.inputs[1]
    if not all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in (num64, den64)):
        return None
    try:
        w = torch.broadcast_to(den64.double(), ev.bad.shape)[ev.bad.to(den64.device)].cpu()
    except RuntimeError:
        return None
    v = ev.inputs[1]  # (taken at ``bad`` too)
    if v.shape != w.shape:
        return None
    moved = (v == 0) & (w != 0)
    scale = float(num64.double().abs().max()) if num64.numel() else 0.0
    if not bool(moved.any()) or scale == 0.0:
        return None
    top = float(w[moved].abs().max())
    return float(w[moved][0]) if top <= _ULPS * torch.finfo(torch.float64).eps * scale else None


def hint(name: str, capture: OpAt | None, ev: Evidence, what: str, advice: str) -> str | None:
    """The ``invalid`` hint for a division whose float64 divisor is such a residue, else None.
    (``what``: the op and what it was given; ``advice``: the division's.)"""
    left = divisor_residue(name, capture, ev)
    if left is None:
        return None
    return (f"{what}, which exact arithmetic makes too: float64's {g(left)} there is a "
            "rounding residue (within float64's precision of the values divided), not a "
            f"value, so float64 is no fix: {advice}")
