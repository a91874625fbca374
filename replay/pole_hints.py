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
and, for a guard's eps that the type rounded to 0 (``sqrt(x + 1e-12)`` in float16), that the
eps was lost.
"""

from __future__ import annotations

import torch

from . import lost_eps
from .cause import Cause
from .cause_text import CLAMPED_DIVISOR, CONSTANT_ZERO_DIVISOR, DIVISOR_OF_DATA
from .clamped_divisor import clamped_to_zero
from .compat import saved_value
from .positive import node_op


def divisor_of_data(node) -> bool:
    """``node`` is a quotient's backward whose divisor needs no gradient (nothing the model
    learns reaches it) and holds an exact 0: the pole of the quotient's derivative."""
    try:
        if node_op(node) != "Div" or node.next_functions[1][0] is not None:
            return False
        other = saved_value(node, "other")
    except Exception:  # (a scalar divisor, a freed node: unknown)
        return False
    return isinstance(other, torch.Tensor) and other.dim() > 0 and bool((other == 0).any())


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


def zero_divisor(node) -> str | None:
    """Why quotient node ``node``'s divisor is 0 (see BackwardOrigin.zero_divisor), if it is."""
    if divisor_of_data(node):
        return "data"
    if constant_zero_divisor(node):
        return "constant"
    return "clamped" if clamped_to_zero(node) else None


def pole_hint(b, cause: Cause) -> str:
    """``cause``'s hint for backward origin ``b`` (a :class:`~replay.backward.BackwardOrigin`)."""
    data = b.zero_divisor == "data" and b.saved_zero == "0" and b.samples
    if data and cause.name == "invalid":
        return DIVISOR_OF_DATA.format(node=b.node)
    if b.zero_divisor in ("constant", "clamped") and cause.name == "invalid":
        text = CONSTANT_ZERO_DIVISOR if b.zero_divisor == "constant" else CLAMPED_DIVISOR
        return text.format(node=b.node)
    if b.lost_eps is None or b.saved_zero != "0" or b.dtype is None:
        return cause.hint
    return cause.hint + lost_eps.said(b.lost_eps, b.dtype)
