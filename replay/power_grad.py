"""A backward origin at ``x ** n`` of an exponent above 1 (``PowBackward0``; ``PowBackward1``
of one learned exponent, an Emax model's Hill coefficient, whose own derivative
``x ** n * log x`` overflows first: a concentration of 7e3 under h = 9.8): the
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
    """The exponent of ``node``, a power's backward (``PowBackward0``, or ``PowBackward1`` of
    one learned exponent: a Hill coefficient), when it is a number above 1 and a derivative of
    its largest base, ``n * x ** (n - 1)`` or (a learned exponent's) ``x ** n * log x``, is
    beyond the base's type (not a huge incoming gradient times a modest derivative); else
    None."""
    try:
        if node_op(node) != "Pow":
            return None
        n, base = saved_value(node, "exponent"), saved_value(node, "self")
    except Exception:  # (a freed node: unknown)
        return None
    learned = isinstance(n, torch.Tensor) and n.dim() == 0 and n.is_floating_point()
    n = float(n.detach()) if learned else n
    if not isinstance(n, (int, float)) or isinstance(n, bool) or n <= 1 \
            or not isinstance(base, torch.Tensor) or not base.is_floating_point() \
            or not base.numel():
        return None
    top = float(base.detach().abs().max().double())
    # (in logs: a float's top ** 39 itself overflows Python's float)
    if not math.isfinite(top) or top <= 0:
        return None
    grads = [math.log(n) + (n - 1) * math.log(top)]
    if learned and top > math.e:  # (the exponent's derivative x ** n * log x)
        grads.append(n * math.log(top) + math.log(math.log(top)))
    if max(grads) <= math.log(torch.finfo(base.dtype).max):
        return None
    return float(n)


def steep_power_cause(b, cause: Cause) -> Cause:
    """``cause`` for backward origin ``b``, an overflow of its derivative when ``b`` is such a
    power and the gradient is finite in float64 (``precision`` or ``overflow``)."""
    if b.steep_power is None or cause.name not in ("precision", "overflow"):
        return cause
    n = b.steep_power
    return Cause("overflow", f"{b.node} made a non-finite gradient, finite in float64: the "
                 f"derivative {n:g} * x ** {n - 1:g} of x ** {n:g} (or x ** {n:g} * log x, "
                 "a learned exponent's) is beyond its type's "
                 "largest value where x ** n was not (x ** n has no pole: its base's exact "
                 "0s are no cause); " + ADVICE.format(n=n))
