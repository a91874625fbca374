"""Guards that rounded away: a positive number added to a value, or clamped under it, that the
value's type rounds to 0.

A Dice loss written for float32, ``(2 * inter) / (card + 1e-8)``, run in float16 (a model and
loss made ``.half()``): 1e-8 is below float16's smallest subnormal (5.96e-08), so ``card + 1e-8``
is ``card``, and an empty class's 0 is divided as if no eps were there. :class:`LostEps` marks
the outputs of such ops as the op finder sees them; the blamed op's evidence says which of its
inputs carry one (:attr:`replay.hits.Evidence.lost_eps`), and :func:`context` says so.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

# ops that take a guard as a number: t + eps, t.clamp_min(eps), t.clamp(min=eps)
_GUARDS = {"add", "add_", "clamp", "clamp_", "clamp_min", "clamp_min_"}


class LostEps:
    def __init__(self) -> None:
        self._of: dict[int, tuple[weakref.ref, float]] = {}

    def track(self, name: str, args: Sequence[Any], out: Any) -> None:
        if name not in _GUARDS or len(args) < 2 or not isinstance(out, torch.Tensor) \
                or not out.is_floating_point():
            return
        eps = args[1]
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
            return
        if eps <= smallest(out.dtype) / 2:  # (round to nearest even: half of it is 0 too)
            self._of[id(out)] = (weakref.ref(out), float(eps))

    def of(self, t: torch.Tensor) -> float | None:
        """The guard ``t`` was made with that its type rounded to 0, or None."""
        hit = self._of.get(id(t))
        return hit[1] if hit is not None and hit[0]() is t else None


def smallest(dtype: torch.dtype) -> float:
    """The type's smallest positive (subnormal) number."""
    f = torch.finfo(dtype)
    return f.smallest_normal * f.eps


def context(ev) -> str:
    """The hint's addition when an input the op took at 0 was guarded by an eps its type
    rounded to 0 (``""`` when none)."""
    for i, eps in enumerate(ev.lost_eps):
        if eps is None or not ev.elementwise[i] or not bool((ev.inputs[i] == 0).any()):
            continue
        dt = ev.input_dtypes[i]
        name = str(dt).removeprefix("torch.")
        return (f"; the eps {eps:g} added to that input is 0 in {name} (its smallest positive "
                f"number is {smallest(dt):.3g}), so it guarded nothing: use an eps {name} "
                f"keeps (at least its smallest normal number, {torch.finfo(dt).tiny:.3g}) or "
                "compute this in float32")
    return ""
