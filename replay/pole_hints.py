"""What a backward origin at its derivative's pole adds to the cause's hint.

An OKS loss, ``exp(-d² / (2 s² k²))``, of an instance annotated with area ``s² = 0``: the
forward is finite (``d² / 0`` is inf, and ``exp(-inf)`` is 0), but ``DivBackward0``'s gradient
is NaN there. The hint said the derivative of div has a pole at the op's input and to add an
eps, true of any quotient; but a divisor that needs no gradient, computed from the batch's
data (an area, a count, a target), is a degenerate record, which an eps would train toward a
made-up target. :func:`pole_hint` says so; for a divisor that is a constant 0 (a scalar: logit
soft-capping's ``cap * tanh(x / cap)`` with ``cap = 0`` meant as "off", a temperature or scale
of 0) that the op should not run at all; for a learned divisor a ReLU cut to 0 (a
hyperprior's predicted scales, :mod:`replay.clamped_divisor`) that it needs a lower bound;
for xlogy's ``x / y`` at x = y = 0 (:mod:`replay.xlogy_pole`) that y must stay off 0;
and, for a guard's eps that the type rounded to 0 (``sqrt(x + 1e-12)`` in float16), that the
eps was lost, in place of the rounding cause's stable-formula and eps-under-the-root advice
(the formula has its eps; the ``1e-8`` that advice proposes is lost in float16 too).
"""

from __future__ import annotations

import torch

from . import lost_eps
from .cause_result import Cause
from .cause_text import DO
from .centred_root import centred_hint, zero_deviations
from .clamped_divisor import clamped_to_zero
from .compat import saved_value
from .hypot_pole import hypot_hint
from .masked_grad import FLAT_INCOMING, HOOK_INCOMING, MASKED_INCOMING, RESIDUAL_INCOMING
from .positive import node_op
from .rounded_bound import RoundedBound
from .rounded_bound import said as said_bound
from .scalar_pole import SCALAR_POLE
from .source import installed_package
from .unit_complement import unit_root_hint
from .unit_eps import narrow_eps
from .vanished_divisor import VANISHED_DIVISOR, vanished_divisor
from .xlogy_pole import OF_ITSELF, ZERO_OF_X, ZERO_ZERO, xlogy_at_zero, xlogy_of_itself, xlogy_of_x

# a backward origin at a quotient whose divisor needs no gradient
DIVISOR_OF_DATA = (
    "{node} made a non-finite gradient from finite incoming gradients, in float64 too: a "
    "division's divisor is exactly 0 there, the pole of the quotient's derivative, and it needs "
    "no gradient (computed from the batch's data: an annotation's area, a count, a target; not "
    "from anything the model learns). A forward that hides the quotient's infinity (exp(-d / 0) "
    "is 0, a torch.where that masks it out) still sends the gradient through it: if such "
    "records are degenerate (an instance of area 0, a box of zero width), drop or repair them "
    "where the data is made or skip them in the loss before the division (an eps would train "
    "toward a made-up target); else make the divisor safe before dividing "
    "(torch.where(den > 0, den, 1))")

# a backward origin at a quotient whose divisor is a scalar constant 0
CONSTANT_ZERO_DIVISOR = (
    "{node} made a non-finite gradient from finite incoming gradients, in float64 too: the "
    "division's divisor is a constant exactly 0 (a scalar no parameter reaches: a soft-cap, "
    "temperature or scale set to 0, often meant as \"off\", or a count that came out 0), so "
    "every quotient is on the pole of its derivative; the forward hid the infinities "
    "(cap * tanh(x / cap) is 0 * +-1), the gradient cannot. Skip the op when the scalar is 0 "
    "(if cap: x = cap * torch.tanh(x / cap)) or reject 0 where the value is configured")

# a backward origin at a quotient whose learned divisor a ReLU cut to 0 (replay.clamped_divisor)
CLAMPED_DIVISOR = (
    "{node} made a non-finite gradient from finite incoming gradients, in float64 too: the "
    "division's divisor is a value the model predicts (a scale, a std, a norm) that a ReLU or "
    "clamp(min=0) made exactly 0 there, the pole of the quotient's derivative; the forward hid "
    "the infinity (a CDF of +-inf is 0 or 1), the gradient cannot. Non-negative is not enough "
    "for a divisor: bound it below before dividing (scale.clamp_min(0.11), a LowerBound, "
    "softplus(x) + eps) instead of ending it with a ReLU")


def zero_divisor_off_graph(node) -> torch.Tensor | None:
    """The divisor of quotient node ``node`` when it needs no gradient and holds an exact 0
    (the pole of the quotient's derivative), else None."""
    try:
        if node_op(node) != "Div" or node.next_functions[1][0] is not None:
            return None
        other = saved_value(node, "other")
    except Exception:  # (a scalar divisor, a freed node: unknown)
        return None
    return other if isinstance(other, torch.Tensor) and bool((other == 0).any()) else None


def divisor_of_data(node) -> bool:
    """``node`` is a quotient's backward whose divisor needs no gradient (nothing the model
    learns reaches it) and holds an exact 0: the pole of the quotient's derivative."""
    other = zero_divisor_off_graph(node)
    return other is not None and other.dim() > 0


def constant_zero_divisor(node) -> bool:
    """``node`` is a quotient's backward whose divisor is a scalar constant 0 (``x / 0.0``, or
    a 0-d tensor no gradient reaches): every element sits on the derivative's pole."""
    try:
        if node_op(node) != "Div" or node.next_functions[1][0] is not None:
            return False
        other = saved_value(node, "other")
    except Exception:  # (a freed node: unknown)
        return False
    return isinstance(other, torch.Tensor) and other.dim() == 0 and float(other) == 0.0


XLOGY_HINTS = {"xlogy": ZERO_ZERO, "xlogy_of_x": ZERO_OF_X, "xlogy_of_itself": OF_ITSELF}


def zero_divisor(node) -> str | None:
    """Why quotient node ``node``'s divisor is 0 (see BackwardOrigin.zero_divisor), if it is."""
    if divisor_of_data(node):
        return "data"
    if constant_zero_divisor(node):
        return "constant"
    if xlogy_of_itself(node):  # (an entropy: xlogy(p, p))
        return "xlogy_of_itself"
    if xlogy_at_zero(node):  # ("xlogy_of_x": y made from x, 0 where x is)
        return "xlogy_of_x" if xlogy_of_x(node) else "xlogy"
    if clamped_to_zero(node):
        return "clamped"
    return "vanished" if vanished_divisor(node) is not None else None  # (d² underflowed)


def pole_hint(b, cause: Cause) -> str:
    """``cause``'s hint for backward origin ``b`` (a :class:`~replay.backward.BackwardOrigin`),
    with what a 0 incoming gradient says of a mask after the op (replay.masked_grad)."""
    hint = centred_hint(b, _pole_hint(b, cause), DO["sqrt_pole"], cause.name)
    hint = hypot_hint(b.node, b.saved_zero, hint)  # (torch.hypot(re, im) at 0 + 0j)
    if cause.name == "precision" and not isinstance(b.lost_eps, RoundedBound):
        hint += narrow_eps(b.node, b.dtype, installed_package(b.source))  # (float32's eps, rounded away in float16; a
        # clamp's bound rounded onto the edge says so itself: replay.rounded_bound)
    if not b.masked or cause.name not in ("invalid", "precision") or "both branches" in hint \
            or zero_deviations(b) \
            or b.zero_divisor in ("constant", "clamped", "xlogy", "xlogy_of_x",
                                  "xlogy_of_itself"):  # (their hints say the
        # forward hid it)
        return hint
    if b.hook is not None:  # (the hook divided the 0 it was given: no pole, no mask to move)
        by = f"sent back by {b.flat_by}'s derivative: a dead unit or branch" if b.flat_by \
            else "the forward dropped or masked the hooked output there"
        return f"{hint}; {HOOK_INCOMING.format(by=by)}"
    if b.flat_by:  # (abs's derivative at 0 sent it, no mask: replay.flat_derivative)
        return f"{hint}; but {FLAT_INCOMING.format(node=b.node, by=b.flat_by)}"
    if b.zeroed_by:  # (no mask: a squared error's 0 at a sample the loss fits)
        return f"{hint}; {RESIDUAL_INCOMING.format(node=b.node, zeroed=b.zeroed_by)}"
    return f"{hint}; but {MASKED_INCOMING.format(node=b.node)}"


def _pole_hint(b, cause: Cause) -> str:
    if said := unit_root_hint(b, cause):  # (sqrt(1 - cos²) at a cosine of 1)
        return said
    if b.scalar_pole and b.module == "<loss>" and cause.name == "invalid":  # (no row's)
        return SCALAR_POLE.format(node=b.node)
    data = b.zero_divisor == "data" and b.saved_zero == "0" and b.samples
    if data and cause.name == "invalid":
        return DIVISOR_OF_DATA.format(node=b.node)
    if b.zero_divisor in XLOGY_HINTS and cause.name == "invalid":
        return XLOGY_HINTS[b.zero_divisor].format(node=b.node)
    if b.zero_divisor in ("constant", "clamped") and cause.name == "invalid":
        text = CONSTANT_ZERO_DIVISOR if b.zero_divisor == "constant" else CLAMPED_DIVISOR
        return text.format(node=b.node)
    if b.zero_divisor == "vanished" and cause.name == "invalid" and b.vanished is not None:
        of = f" ({', '.join(b.params)})" if b.params else ""
        return VANISHED_DIVISOR.format(node=b.node, of=of, low=b.vanished)
    if isinstance(b.lost_eps, RoundedBound):  # (a clamp's bound rounded onto acos's edge)
        return cause.hint + said_bound(b.lost_eps) if b.saved_zero == "1" else cause.hint
    if b.lost_eps is None or b.saved_zero != "0" or b.dtype is None:
        return cause.hint
    return _without_formula_advice(cause.hint, b.lost_eps) + lost_eps.said(b.lost_eps, b.dtype)


# the rounding cause's generic advice, which an eps the type rounded to 0 makes wrong: the
# formula already adds one (BasicSR's Charbonnier sqrt(d ** 2 + 1e-12) in float16), and the
# "torch.sqrt(x + 1e-8)" it proposes is lost in float16 too
_FORMULA_ADVICE = ("; " + DO["stable"] + "; " + DO["root"], "; " + DO["stable"])


def _without_formula_advice(hint: str, eps) -> str:
    """``hint`` without its stable-formula and eps-under-the-root advice when ``eps`` is a
    positive eps the type lost (not one that is exactly 0, nor a clamp's floor)."""
    if type(eps) is not float or eps <= 0:  # (a Floor, a CarriedEps: their own words)
        return hint
    for advice in _FORMULA_ADVICE:
        if hint.endswith(advice):
            return hint[:-len(advice)]
    return hint
