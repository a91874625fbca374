"""A clamp's bound that the value's type rounded onto the domain edge it was written to keep
off: ArcFace's ``cos.clamp(-1 + 1e-7, 1 - 1e-7)`` under bfloat16 autocast. 1 - 1e-7 is 1.0 in
bfloat16 (its spacing below 1 is 2^-8), so a cosine that rounds to 1 or past it is clamped to
exactly 1, acos's derivative is infinite there, and the hint's "clamp into (-1 + eps, 1 - eps)"
is what the code already does. :class:`~replay.lost_eps.GuardNodes` keeps such a clamp's node
with the bound (a :class:`RoundedBound`); :func:`said` is the hint's addition. Any edge at an
integer other than 0 is one (a Tweedie power's ``p.clamp(1 + 1e-8, 2 - 1e-8)`` is 1.0 in
float32, and ``1 - p`` is 0: :class:`~replay.lost_eps.LostEps` follows the bound through such a
shift by a number, whose value at the bound is :attr:`RoundedBound.at`); a bound rounded to 0
is an eps lost, :mod:`replay.lost_eps`' own."""

from __future__ import annotations

import math
from typing import Any

import torch


class RoundedBound(float):
    """A clamp's bound as written (0.9999999), with ``kept``, what its type made of it (1.0),
    that type, and ``at``: what the clamped value is there after a shift by a number (0 for
    ``1 - p``; ``kept`` itself unshifted)."""

    kept: float
    dtype: torch.dtype
    at: float

    def shifted(self, at: float) -> RoundedBound:
        """The same bound, met by a value made from the clamped one that is ``at`` there."""
        found = RoundedBound(self)
        found.kept, found.dtype, found.at = self.kept, self.dtype, at
        return found


def rounded_bound(args, kwargs: dict[str, Any], out: Any) -> RoundedBound | None:
    """The bound of ``clamp(x, min, max)`` (``args``, ``kwargs``), no integer, that the
    floating output's type rounded onto an integer other than 0 (-1 or 1 from inside: the
    edge of acos, asin, atanh; 1 or 2 from inside (1, 2): a Tweedie power's), or None."""
    if not isinstance(out, torch.Tensor) or not out.is_floating_point():
        return None
    lo = args[1] if len(args) > 1 else kwargs.get("min")
    hi = args[2] if len(args) > 2 else kwargs.get("max")
    found = []
    for b in (hi, lo):
        if isinstance(b, float) and math.isfinite(b) and b != round(b):
            try:
                kept = float(torch.tensor(b, dtype=out.dtype))
            except (TypeError, RuntimeError):  # (a type torch.tensor cannot make: unknown)
                return None
            if kept != 0 and kept == round(kept) and abs(kept - b) <= _spacing(kept, b, out.dtype):
                found.append(RoundedBound(b))
                found[-1].kept, found[-1].dtype, found[-1].at = kept, out.dtype, kept
    # (the bound the values sit on, where both rounded: 1 + 1e-8 and 2 - 1e-8 in float32)
    return next((f for f in found if bool((out == f.kept).any())), found[0]) if found else None


def _spacing(edge: float, bound: float, dtype: torch.dtype) -> float:
    """The type's spacing next to the integer ``edge`` on ``bound``'s side of it."""
    ulp = 2.0 ** math.floor(math.log2(abs(edge))) * torch.finfo(dtype).eps  # (away from 0)
    toward_zero = abs(bound) < abs(edge)
    return ulp / 2 if toward_zero and abs(edge) == 2.0 ** math.floor(math.log2(abs(edge))) \
        else ulp


def said(bound: RoundedBound) -> str:
    """The hint's addition for an origin at the edge whose input ``bound`` clamped (or a
    shift of the clamped value: ``1 - p``)."""
    name = str(bound.dtype).removeprefix("torch.")
    wider = _wider(bound)
    if abs(bound.kept) == 1 and abs(bound) < 1:
        step = torch.finfo(bound.dtype).eps / 2  # (the spacing just below 1)
        return (f"; the code clamps already, but its bound {bound!r} is {bound.kept:g} in "
                f"{name} (whose spacing below 1 is {step:.3g}), so the clamp put the input on "
                f"the edge instead of keeping it off: use an eps {name} resolves (1 - eps with "
                f"eps of at least {step:.3g})" + wider)
    edge, step = bound.kept, _spacing(bound.kept, bound, bound.dtype)
    side, sign = ("below", "-") if bound < edge else ("above", "+")
    made = "" if bound.at == edge else \
        f" (the op's input, {bound.at:g} there, is made from the clamped value)"
    return (f"; the code clamps already, but its bound {bound!r} is {edge:g} in {name} (whose "
            f"spacing {side} {edge:g} is {step:.3g}), so the clamp put the value on the edge "
            f"{edge:g} instead of keeping it off{made}: use an eps {name} resolves ({edge:g} "
            f"{sign} eps with eps of at least {step:.3g})" + wider)


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


def _wider(bound: RoundedBound) -> str:
    """The wider type that keeps ``bound`` off the edge: float32 under half precision (the
    clamped value computed outside autocast), float64 for a float32 bound (HGCN runs its
    hyperbolic layers in float64, where 1 - 1e-15 is below 1); "" when none does."""
    if torch.finfo(bound.dtype).bits < 32:
        return (" or compute what is clamped in float32 (outside autocast, or .float() before "
                "it: a cosine's product of unit vectors, a norm)")
    if bound.dtype is torch.float32 and float(bound) != bound.kept:  # (a Python float: float64)
        return f" or compute what is clamped in float64, where {bound!r} stays off the edge"
    return ""
