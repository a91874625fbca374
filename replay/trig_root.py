"""A cosine or sine at one of its zeros, rounded below 0: ``cos(deg2rad(lat))`` at a global
grid's poles. float32's pi/2 is above pi/2, so its cosine is -4.4e-8, where exact arithmetic
gives 0 and float64 6e-17; a ``sqrt`` of the latitude weights (a weighted RMSE's
``sqrt(w) * err``) or their ``log`` is then NaN. The generic ``precision`` advice blamed a
cancelled variance (``E[x²] − E[x]²``), which nothing here computes. :class:`TrigRoots` marks
cos and sin results and what views and scalings make of them (``w / w.mean()``);
:func:`forward_hint` says what the value is and how to keep it in the domain.
"""

from __future__ import annotations

import torch

from .memo import TensorSet

__all__ = ["TrigRoots", "forward_hint"]

_MAKERS = {"cos", "sin"}
# ops that keep such a value's sign where its scale is positive (a mean, a count)
_CARRY = {"div", "mul", "view", "_unsafe_view", "reshape", "select", "slice", "squeeze",
          "unsqueeze", "expand", "index", "clone", "_to_copy", "contiguous", "t", "transpose",
          "permute", "alias"}
_NEAR = 1e-3  # a rounding of the angle moves cos(pi/2) by about its type's eps times pi/2


class TrigRoots:
    """cos and sin results, and views and scalings of them, by tensor identity (weakly)."""

    def __init__(self):
        self._made = TensorSet()

    def track(self, name: str, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        """After an op with finite floating inputs ``ins`` ran (its first: the one scaled)."""
        if len(outs) != 1 or not ins:
            return
        if name in _MAKERS or (name in _CARRY and ins[0] in self._made):
            self._made.add(outs[0])

    def of(self, t: torch.Tensor) -> bool:
        return t in self._made


def forward_hint(what: str, ev) -> str | None:
    """The ``precision`` hint of an op whose input below 0 there is such a value, just below
    0 (a rounding at a zero of cos or sin, not a value of any size), else None."""
    marks = getattr(ev, "trig", None) or []
    if not any(m and bool((v < 0).any()) and bool((v[v < 0] > -_NEAR).all())
               for v, m in zip(ev.inputs, marks)):
        return None
    return (f"{what}: that input is a cosine or sine at one of its zeros (cos(lat) area weights "
            "on a grid whose rows reach ±90°; a cosine noise schedule's cos(π/2) at its last "
            "step; sin(π)), which exact arithmetic keeps at 0, but the angle is rounded "
            "(float32's π/2 is above π/2: its cosine is -4.4e-08), so the value is just below "
            "0: clamp it at 0 before the op (torch.cos(x).clamp_min(0); a schedule's alphas "
            "clamped into the domain, as diffusers clips its betas), or keep the angles off the "
            "zero (a grid's cell centres, which never reach the poles)")
