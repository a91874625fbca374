"""A root of ``1 - x²`` (or ``1 - x * x``) whose ``x`` is exactly ±1 (a backward origin) or
rounded past ±1 (a forward one).

A sine taken from a cosine — ArcFace's and AAM-softmax's ``cos(θ + m) = cos·cos m − sin·sin m``
with ``sin = sqrt(1 − cos²)``, a rotation's angle from its dot product — is 0 where the
cosine of two unit vectors is 1 (an embedding that coincides with its class's weight, a head
started from the embeddings themselves), and the derivative of sqrt is infinite there. The
generic advice for a root at its pole ("put an eps under the root", "a stable formula such as
torch.var") names neither the cosine nor the clamp that avoids it: ``clamp(1 - cos², 0, 1)``,
which such code often writes, keeps the pole.
"""

from __future__ import annotations

import torch

from .compat import saved_value
from .memo import TensorMemo
from .positive import node_op
from .trig_root import forward_hint as trig_root_hint

_ROOTS = {"Sqrt", "Rsqrt"}
_PASS = {"Clamp", "ClampMin", "Clamp_min", "Clone", "View", "Reshape", "Alias"}


def _next(node, i: int = 0):
    try:
        return node.next_functions[i][0]
    except Exception:  # (no input, or a node that cannot say)
        return None


def _squared(node) -> torch.Tensor | None:
    """The ``x`` of ``x * x`` or ``x ** 2`` that autograd node ``node`` made, or None."""
    op = node_op(node)
    try:
        if op == "Pow" and saved_value(node, "exponent") == 2:
            return saved_value(node, "self")
        if op == "Mul":
            a, b = saved_value(node, "self"), saved_value(node, "other")
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) \
                    and a.shape == b.shape and torch.equal(a, b):
                return a
    except Exception:  # (a freed node: unknown)
        return None
    return None


def unit_at_root(node) -> int:
    """How many entries of ``x`` are exactly ±1 where backward ``node`` is a root of
    ``1 - x²`` (through a clamp or a view), or 0."""
    if node is None or node_op(node) not in _ROOTS:
        return 0
    return _past_one(_next(node), lambda x: x.abs() == 1)


class UnitSquares:
    """``1 - x²`` made in the watched code (``x * x``, ``x ** 2``, ``square``; then ``1 - y``,
    through views and clamps): per result, kept while it lives unmodified, its ``|x|``. The
    watched ops run below autograd, so no graph says it there."""

    def __init__(self):
        self._squares = TensorMemo()  # x², with its |x|
        self._complements = TensorMemo()  # 1 - x², with its |x|

    def track(self, name: str, ins: list[torch.Tensor], outs: list[torch.Tensor],
              leaves: list) -> None:
        """After op ``name`` ran on finite ``ins`` (``leaves``: all its arguments)."""
        if len(outs) != 1 or not outs[0].is_floating_point() or not ins:
            return
        numbers = [v for v in leaves if isinstance(v, (int, float)) and not isinstance(v, bool)]
        x = ins[0]
        if (name == "mul" and len(ins) == 2 and ins[1] is x) or name == "square" \
                or (name == "pow" and len(ins) == 1 and numbers == [2]):
            self._squares.put(outs[0], x.detach().abs())
        elif name == "rsub" and len(ins) == 1 and numbers[:1] == [1] \
                and (kept := self._squares.get(x)) is not None:
            self._complements.put(outs[0], kept)
        elif name in _KEEPS and (kept := self._complements.get(x)) is not None \
                and outs[0].shape == kept.shape:
            self._complements.put(outs[0], kept)

    def at(self, t: torch.Tensor, bad: torch.Tensor) -> int:
        """How many of ``t``'s non-finite positions ``bad`` are ``1 - x²`` of an x past ±1."""
        kept = self._complements.get(t)
        if kept is None or kept.shape != bad.shape:
            return 0
        return int((kept[bad.to(kept.device)] > 1).sum())


_KEEPS = {"clone", "view", "_unsafe_view", "reshape", "alias", "contiguous", "_to_copy"}


def _past_one(fn, where) -> int:
    """The entries ``where`` holds of the ``x`` of autograd node ``fn``'s ``1 - x²``, or 0."""
    while fn is not None and node_op(fn) in _PASS:
        fn = _next(fn)
    if fn is None or node_op(fn) != "Rsub" or _next(fn) is None:
        return 0
    x = _squared(_next(fn))
    if x is None or not x.is_floating_point():
        return 0
    return int(where(x.detach()).sum())


def forward_hint(what: str, ev) -> str | None:
    """The ``precision`` hint of an op whose input is ``1 - x²`` of an x rounded past ±1 (see
    :class:`UnitSquares`), or a cosine rounded below its zero (:mod:`replay.trig_root`), else
    None."""
    n = getattr(ev, "unit_square", 0)
    if not n:
        return trig_root_hint(what, ev)
    return (f"{what}: that input is 1 - x² of an x that rounding put past ±1 in {n} "
            f"entr{'y' if n == 1 else 'ies'}, " + _SINE)


_SINE = ("a sine taken from a cosine, sqrt(1 - cos²), as an AAM-softmax / ArcFace margin "
         "cos(θ + m) = cos·cos m − sin·sin m writes it: a cosine of unit vectors is 1 in exact "
         "arithmetic where an embedding coincides with its class's weight, and a few units in "
         "the last place either side in floating point; clamp x inside the domain before "
         "squaring (cos.clamp(-1 + eps, 1 - eps), eps 1e-7 in float32, 1e-3 in float16) or "
         "floor the difference away from 0 (sqrt((1 - cos²).clamp_min(eps))); clamping "
         "1 - cos² at 0 keeps the infinite derivative at 0")


def unit_root_hint(b, cause) -> str | None:
    """The hint for backward origin ``b`` at such a root (see :func:`unit_at_root`) whose
    ``cause`` is a pole's, else None."""
    if cause.name not in ("invalid", "precision") or not b.unit_complement:
        return None
    n = b.unit_complement
    return (f"{b.node}: its input is 1 - x² of an x at exactly ±1 in {n} "
            f"entr{'y' if n == 1 else 'ies'}, where the derivative of the root is infinite: "
            + _SINE)
