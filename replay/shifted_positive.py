"""A divisor that a positive op (softplus, exp, sigmoid) made, plus a number: a scale with a
floor, robomimic's GMM ``softplus(s) + min_std`` or ``exp(log_std) + eps``.

The graph keeps no number added (``AddBackward0`` has no input for it), so the sum is no
positive value to :mod:`replay.positive`, and a divisor it made that is 0 read as "small
finite numbers, no exponential". But where such a sum is exactly 0 the op underflowed and the
number added was 0 (a floor switched off) or too small to show beside it: the fix is that
floor, not a clamp somewhere else.
"""

from __future__ import annotations

from .positive import node_op

_MAKERS = {"Softplus": "softplus", "Exp": "exp", "Sigmoid": "sigmoid"}
_VIEWS = {"View", "UnsafeView", "ReshapeAlias", "Squeeze", "Unsqueeze", "Select", "Slice",
          "Expand", "Clone", "Alias", "Permute", "Transpose", "Unbind", "Split", "Index"}
_SHIFTS = {"Add"}  # with one input off the graph: a number or a constant tensor

ADVICE = ("it is {op}'s result plus a number (a floor: softplus(s) + min_std), positive in "
          "exact arithmetic, but {op} underflowed to 0 there and the number added was 0 or too "
          "small to show beside it: give the floor a value the type resolves (min_std = 1e-4 "
          "in float32, as robomimic's GMM policy keeps; F.softplus(s) + 1e-3) or clamp the "
          "value before the division (scale.clamp_min(eps))")


def shifted_maker(t, depth: int = 8, fn=None) -> str | None:
    """The positive op (``"softplus"``, ``"exp"``, ``"sigmoid"``) whose result, through views
    and at least one addition of a number, made tensor ``t`` (``fn``: the node that made a
    detached copy ``t``); None otherwise (a value with no number added is
    :mod:`replay.positive`'s)."""
    try:
        fn, shifted = fn or t.grad_fn, False
        for _ in range(depth):
            if fn is None:
                return None
            op = node_op(fn)
            if op in _MAKERS:
                return _MAKERS[op] if shifted else None
            nexts = [f for f, _ in fn.next_functions]
            if op in _SHIFTS and len(nexts) == 2 and nexts[1] is None:
                shifted = True  # (not Sub: a number taken away can cancel the value)
            elif op not in _VIEWS:
                return None
            fn = nexts[0]
    except Exception:  # not an autograd node, or one that cannot say
        return None
    return None
