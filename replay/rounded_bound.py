"""A clamp's bound that the value's type rounded onto the domain edge it was written to keep
off: ArcFace's ``cos.clamp(-1 + 1e-7, 1 - 1e-7)`` under bfloat16 autocast. 1 - 1e-7 is 1.0 in
bfloat16 (its spacing below 1 is 2^-8), so a cosine that rounds to 1 or past it is clamped to
exactly 1, acos's derivative is infinite there, and the hint's "clamp into (-1 + eps, 1 - eps)"
is what the code already does. :class:`~replay.lost_eps.GuardNodes` keeps such a clamp's node
with the bound (a :class:`RoundedBound`); :func:`said` is the hint's addition."""

from __future__ import annotations

import math
from typing import Any

import torch


class RoundedBound(float):
    """A clamp's bound as written (0.9999999), with ``kept``, what its type made of it (1.0),
    and that type."""

    kept: float
    dtype: torch.dtype


def rounded_bound(args, kwargs: dict[str, Any], out: Any) -> RoundedBound | None:
    """The bound of ``clamp(x, min, max)`` (``args``, ``kwargs``) strictly inside (-1, 1)
    that the floating output's type rounded onto -1 or 1 (the edge of acos, asin, atanh), or
    None."""
    if not isinstance(out, torch.Tensor) or not out.is_floating_point():
        return None
    lo = args[1] if len(args) > 1 else kwargs.get("min")
    hi = args[2] if len(args) > 2 else kwargs.get("max")
    for b in (hi, lo):
        if isinstance(b, float) and math.isfinite(b) and abs(b) < 1:
            try:
                kept = float(torch.tensor(b, dtype=out.dtype))
            except (TypeError, RuntimeError):  # (a type torch.tensor cannot make: unknown)
                return None
            if abs(kept) == 1:
                found = RoundedBound(b)
                found.kept, found.dtype = kept, out.dtype
                return found
    return None


def said(bound: RoundedBound) -> str:
    """The hint's addition for a backward origin at +-1 whose input ``bound`` clamped."""
    name = str(bound.dtype).removeprefix("torch.")
    step = torch.finfo(bound.dtype).eps / 2  # (the spacing just below 1)
    return (f"; the code clamps already, but its bound {bound!r} is {bound.kept:g} in {name} "
            f"(whose spacing below 1 is {step:.3g}), so the clamp put the input on the edge "
            f"instead of keeping it off: use an eps {name} resolves (1 - eps with eps of at "
            f"least {step:.3g})" + ("" if torch.finfo(bound.dtype).bits >= 32 else
                                    " or compute what is clamped in float32 (outside "
                                    "autocast, or .float() before it: a cosine's product of "
                                    "unit vectors, a norm)"))


# backward nodes of ops whose output values are their input's (moved, picked, copied): a
# clamped value reaches acos through them unchanged (ArcFace's cos.gather(1, labels))
_MOVERS = ("Gather", "Select", "Slice", "Index", "View", "UnsafeView", "Reshape", "Expand",
           "Clone", "Unsqueeze", "Squeeze", "T", "Transpose", "Permute", "Diagonal", "ToCopy")


def moved_bound(nodes: list[tuple[Any, float]], nexts: list[Any], depth: int = 4):
    """The :class:`RoundedBound` of a clamp node among ``nodes`` that ``nexts`` (a node's next
    functions) reach through at most ``depth`` nodes of ops that move values, or None."""
    for fn in nexts:
        for n, bound in nodes:
            if fn is n and isinstance(bound, RoundedBound):
                return bound
        name = type(fn).__name__.removesuffix("Backward0").removesuffix("Backward1")
        if depth > 0 and name in _MOVERS:
            found = moved_bound(nodes, [f for f, _ in fn.next_functions if f is not None],
                                depth - 1)
            if found is not None:
                return found
    return None
