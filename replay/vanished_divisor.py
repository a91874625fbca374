"""A quotient's backward at a learned divisor that is not 0 but so near it that its square
underflows (below the type's smallest normal value): the derivative of ``x / d`` with respect
to ``d``, ``-x / d²``, then overflows, or is x/0.

A GP kernel divides the inputs by its lengthscale (GPyTorch's ``x1.div(self.lengthscale)``);
a lengthscale prior whose density grows without bound at 0 (a Gamma of concentration below 1)
lets L-BFGS-B drive the raw lengthscale to -355, the lengthscale through its softplus to 4e-155,
whose square is below float64's smallest normal value: the forward's quotient is still finite, the
gradient is not. No eps in the op and no mask helps: the parameter left the range its model
is meant for, and its bound (a constraint's lower bound, a prior that does not favour 0) is the
fix. :func:`vanished_divisor` tells the node; :data:`VANISHED_DIVISOR` is the hint.
"""

from __future__ import annotations

import torch

from .compat import saved_value
from .positive import node_op

VANISHED_DIVISOR = (
    "{node} made a non-finite gradient from finite incoming gradients, in float64 too: the "
    "division's divisor is a learned value{of} that is not 0 but as small as {low:.3g}, so "
    "its square, in the derivative of x / d (-x / d²), is below the type's smallest normal "
    "value and the gradient overflows; the forward's quotient stayed finite. The parameter was driven toward 0 (an "
    "objective or prior that rewards it there: a lengthscale prior whose density grows "
    "without bound at 0, a Gamma of concentration below 1; a learning rate that overshot): "
    "bound it away from 0 where it is parametrised (a constraint's lower bound, "
    "GreaterThan(1e-4), softplus(x) + eps) or fix the prior, rather than an eps in the op")


def vanished_divisor(node) -> float | None:
    """The smallest magnitude of quotient node ``node``'s divisor when a gradient reaches it
    (a learned value), none of its entries is 0 and the square of that smallest one is below
    its type's smallest normal value; else None."""
    try:
        if node_op(node) != "Div" or node.next_functions[1][0] is None:
            return None
        other = saved_value(node, "other")
    except Exception:  # (a scalar divisor, a freed node: unknown)
        return None
    if not isinstance(other, torch.Tensor) or not other.is_floating_point() \
            or not other.numel() or bool((other == 0).any()) \
            or not bool(torch.isfinite(other).all()):
        return None
    low = other.detach().abs().min()
    return float(low) if float(low * low) < torch.finfo(other.dtype).tiny else None
