"""A domain op's input past its edge (acos of 1.0000001, sqrt of a cancelled variance) by a
margin rounding explains: the float64 re-run crossed the edge too, by a margin at least 1000x
smaller, so the value is not truly outside the domain (``precision``, not ``invalid``)."""

from __future__ import annotations

import torch

from .dispatch import OpAt
from .hits import Evidence

__all__ = ["edge_excess", "rounded_past_edge"]


def edge_excess(base: str, x: torch.Tensor) -> float | None:
    """How far past its domain edge op ``base``'s first input ``x`` went (0 when not past);
    None for an op without such an edge."""
    if base in ("acos", "asin", "atanh"):
        d = x.abs() - 1
    elif base == "acosh":
        d = 1 - x
    elif base == "log1p":
        d = -1 - x
    elif base in ("sqrt", "log", "log2", "log10", "rsqrt", "pow"):
        d = -x
    else:
        return None
    return float(d.clamp_min(0).max()) if d.numel() else None


def rounded_past_edge(name: str, ev: Evidence, capture: OpAt | None):
    """(the dtype's, float64's) margin past the domain edge when the float64 re-run crossed it
    too but by a margin at least 1000x smaller: a unit vectors' cosine is 1.0000001 in float32
    and 1.0000000000000004 in float64, a cancelled variance -8 and -1e-9. Rounding moved the
    input in both types (the margin scales with the epsilon); a value truly outside the domain
    is as far out in both. None otherwise."""
    if capture is None or capture.inputs is None or not ev.inputs or not ev.elementwise[0] \
            or ev.input_dtypes[0] == torch.float64:
        return None
    try:
        x64 = torch.broadcast_to(capture.inputs[0].double(),
                                 ev.bad.shape)[ev.bad.to(capture.inputs[0].device)].cpu()
    except RuntimeError:
        return None
    base = name.rstrip("_")
    e32, e64 = edge_excess(base, ev.inputs[0]), edge_excess(base, x64)
    if e32 is None or e64 is None or not e32 > 0 or not 0 < e64 <= e32 * 1e-3:
        return None
    return e32, e64
