"""A backward origin at ``xlogy(x, y)`` where x and y are both 0.

``torch.xlogy`` is the fix the replay gives for ``p * log(p)`` (0 log 0 is 0 by convention,
not NaN), and a KL / Poisson NMF loss ``xlogy(v, v) - xlogy(v, wh)`` takes counts of 0 with
it; but the gradient for ``y`` is ``x / y``, 0/0 where the model's ``y`` is exactly 0 too (a
rate or a factor row a projection ``clamp_(min=0)`` or a ReLU ended at 0). The forward is
finite, the backward NaN: the generic hint (a masked forward's other branch) does not say it.
"""

from __future__ import annotations

import torch

from .compat import saved_value
from .positive import node_op

ZERO_ZERO = (
    "{node} made a non-finite gradient from finite incoming gradients, in float64 too: "
    "xlogy(x, y) is 0 where x = 0 by convention (0 log 0 = 0) even at y = 0, but its gradient "
    "for y is x / y, 0/0 = NaN where y is exactly 0 as well; y is something the model makes (a "
    "rate or a probability; W @ H of a factor row that a projection clamp_(min=0), a ReLU or "
    "an underflow left all 0): keep it off 0 before the xlogy (project onto [eps, inf) with "
    "clamp_(min=eps), softplus(...) + eps, y + eps)")


def xlogy_at_zero(node) -> bool:
    """``node`` is xlogy's backward, its ``other`` needing a gradient, and it saved an entry
    with both arguments exactly 0 (the gradient x / y is 0/0 there)."""
    try:
        if node_op(node) != "Xlogy" or node.next_functions[1][0] is None:
            return False
        x, y = saved_value(node, "self"), saved_value(node, "other")
    except Exception:  # (a freed node, a scalar argument: unknown)
        return False
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        return False
    try:
        return bool(((x == 0) & (y == 0)).any())
    except RuntimeError:  # (shapes that do not broadcast: not this op's)
        return False
