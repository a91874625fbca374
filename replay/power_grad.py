"""A backward origin at ``x ** n`` of a constant exponent above 1 (``PowBackward0``): the
derivative ``n * x ** (n - 1)`` overflowed where the forward's ``x ** n`` had not (a dense
associative memory's ``relu(x) ** 40`` at x = 9: 1.6e38 forward, 40 * 9 ** 39 = 6.8e38
backward), and a saturated gradient's 0 times that infinity made NaN. Such a power has no
pole: the exact 0s a ReLU puts in its base are where its derivative is 0, yet they read as
"rounding put the input on its pole" (``precision``). The cause is an overflow, and the fix
the forward's own: normalise the base before the power (``replay.power_overflow``)."""

from __future__ import annotations

import math

import torch

from .cause import Cause
from .compat import saved_value
from .positive import node_op
from .power_overflow import ADVICE


def steep_power(node) -> float | None:
    """The exponent of ``node``, a scalar power's backward (``PowBackward0``), when it is a
    number above 1 and the derivative ``n * x ** (n - 1)`` of its largest base is beyond the
    base's type (not a huge incoming gradient times a modest derivative); else None."""
    try:
        if node_op(node) != "Pow":
            return None
        n, base = saved_value(node, "exponent"), saved_value(node, "self")
    except Exception:  # (a freed node: unknown)
        return None
    if not isinstance(n, (int, float)) or isinstance(n, bool) or n <= 1 \
            or not isinstance(base, torch.Tensor) or not base.is_floating_point() \
            or not base.numel():
        return None
    top = float(base.detach().abs().max().double())
    # (in logs: a float's top ** 39 itself overflows Python's float)
    if not math.isfinite(top) or top <= 0 or math.log(n) + (n - 1) * math.log(top) \
            <= math.log(torch.finfo(base.dtype).max):
        return None
    return float(n)


def steep_power_cause(b, cause: Cause) -> Cause:
    """``cause`` for backward origin ``b``, an overflow of its derivative when ``b`` is such a
    power and the gradient is finite in float64 (``precision`` or ``overflow``)."""
    if b.steep_power is None or cause.name not in ("precision", "overflow"):
        return cause
    n = b.steep_power
    return Cause("overflow", f"{b.node} made a non-finite gradient, finite in float64: the "
                 f"derivative {n:g} * x ** {n - 1:g} of x ** {n:g} is beyond its type's "
                 "largest value where x ** n was not (x ** n has no pole: its base's exact "
                 "0s are no cause); " + ADVICE.format(n=n))
