"""A backward origin at ``x ** n`` of an exponent above 1 (``PowBackward0``; ``PowBackward1``
of one learned exponent, an Emax model's Hill coefficient, whose own derivative
``x ** n * log x`` overflows first: a concentration of 7e3 under h = 9.8): the
derivative ``n * x ** (n - 1)`` overflowed where the forward's ``x ** n`` had not (a dense
associative memory's ``relu(x) ** 40`` at x = 9: 1.6e38 forward, 40 * 9 ** 39 = 6.8e38
backward), and a saturated gradient's 0 times that infinity made NaN. Such a power has no
pole: the exact 0s a ReLU puts in its base are where its derivative is 0, yet they read as
"rounding put the input on its pole" (``precision``). The cause is an overflow, and the fix
the forward's own: normalise the base before the power (``replay.power_overflow``). Where the
forward's ``x ** n`` overflowed too and an op after it saturated on the infinity (the tanh
form of GELU written out, ``tanh(c * (x + 0.044715 * x ** 3))``, under float16 autocast:
``tanh(inf)`` is 1, the forward finite), that infinity is said (:data:`HIDDEN`), with the
float32 power or the fused form as the fix, not a base to normalise."""

from __future__ import annotations

import math

import torch

from .cause_result import Cause
from .compat import saved_value
from .positive import node_op
from .power_overflow import ADVICE


class Exponent(float):
    """A steep power's exponent, and whether its forward ``x ** n`` overflowed the base's type
    too (an infinity a saturating op after it hid: ``tanh(inf)`` is 1)."""

    forward_overflowed: bool = False


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
    top_of_type = math.log(torch.finfo(base.dtype).max)
    if max(grads) <= top_of_type:
        return None
    exponent = Exponent(n)
    exponent.forward_overflowed = n * math.log(top) > top_of_type
    return exponent


HIDDEN = ("{node} made a non-finite gradient, finite in float64: x ** {n:g} overflowed "
          "{dtype} in the forward too, and an op after it that saturates hid the infinity "
          "(tanh(inf) is 1: the tanh form of GELU written out, 0.5 * x * (1 + tanh(c * (x + "
          "0.044715 * x ** 3))), returns x), so the forward is finite; in the backward that "
          "op's derivative at the infinity is 0, and 0 times the power's infinite derivative "
          "{n:g} * x ** {m:g} is NaN: compute the power in float32 (x.float() ** {n:g}, or "
          "the function outside autocast), or use a fused form that takes no power "
          "(F.gelu(x, approximate='tanh'), nn.GELU(approximate='tanh') for that GELU)")


def steep_power_cause(b, cause: Cause) -> Cause:
    """``cause`` for backward origin ``b``, an overflow of its derivative when ``b`` is such a
    power and the gradient is finite in float64 (``precision`` or ``overflow``)."""
    if b.steep_power is None or cause.name not in ("precision", "overflow"):
        return cause
    n = b.steep_power
    if getattr(n, "forward_overflowed", False):
        return Cause("overflow", HIDDEN.format(node=b.node, n=n, m=n - 1,
                                               dtype=str(b.dtype).removeprefix("torch.")))
    return Cause("overflow", f"{b.node} made a non-finite gradient, finite in float64: the "
                 f"derivative {n:g} * x ** {n - 1:g} of x ** {n:g} (or x ** {n:g} * log x, "
                 "a learned exponent's) is beyond its type's "
                 "largest value where x ** n was not (x ** n has no pole: its base's exact "
                 "0s are no cause); " + ADVICE.format(n=n))
