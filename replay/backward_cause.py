"""The cause of a backward origin without evidence of its own op: the node's name (its forward
op's derivative and poles), what it saved (an infinity, a NaN, a 0 on the pole) and whether the
float64 step is finite tell ``invalid``, ``underflow``, ``precision`` and ``overflow`` apart
(:func:`replay.cause.classify` calls it for the backward phase)."""

from __future__ import annotations

import re

import torch

from recorder.finite import label

from . import domains, exact_edge
from .cause_result import Cause
from .cause_text import DO, LSE_ALL_INF, NEAR_POLE_EXP, OWN_INF, inf_arith
from .positive import POSITIVE_OPS as _POSITIVE_OPS
from .wider_type import op_name as _name
from .wider_type import type_name as _type
from .wider_type import wider as _wider


def _unit_pole(op: str, name: str, fn: str, dtype: torch.dtype, still: bool, gap) -> Cause:
    """acos, asin, atanh or acosh given exactly +-1 (acosh: 1), where the derivative is
    infinite; ``gap``: the float64 input's distance to it (replay.exact_edge)."""
    edge, advice = ("1", DO["acosh"]) if name == "acosh" else (
        "+-1", DO[name if name in ("atanh", "erfinv") else "unit"])
    return Cause(*exact_edge.unit_pole(op, name, fn, _type(dtype), edge, advice, still, gap))


def backward(node: str | None, still: bool, dtype: torch.dtype,
              saved: str | None = None, at_pole: str | None = None,
              underflowed: bool = False, inner: str | None = None,
              edge_gap=lambda: None) -> Cause:
    op = node or "the backward node"
    name = m.group(1).lower() if (m := re.fullmatch(r"(\w+?)Backward\d*", node or "")) else None
    fn = f"the derivative of {name}" if name else "the derivative"
    if saved in ("+inf", "-inf"):
        return _saved_inf(op, name, saved, inner, still, dtype)
    if saved == "nan" and not still:  # (outside the domain by rounding: a cancellation)
        return Cause("precision", f"{op} used a NaN it saved in the forward, in a branch "
                     f"masked before the output, made in {_type(dtype)} only (the step is "
                     f"finite in float64): {DO['masked_rounding']}")
    if saved == "nan":
        # the forward ran the op outside its domain in a branch it then masked out
        return Cause("invalid", f"{op} used a NaN it saved in the forward, where the op ran "
                     "outside its domain (sqrt or log of a negative, 0/0) in a branch masked "
                     f"before the output: {DO['masked']}")
    if (still or at_pole == "tie") and name and (gap := domains.value_gap(name)):
        return _at_tie(op, gap, still, dtype)
    if at_pole == "1" and name and domains.derivative_pole(name):
        return _unit_pole(op, name, fn, dtype, still, None if still else edge_gap())
    if inner and not (name and domains.derivative_pole(name)):
        fn = f"its backward's {inner}"
    if still:  # (sqrt at 0: mostly a distance written out, TransE's sqrt(((h + r - t)**2)...))
        return Cause("invalid", f"{op} made a non-finite gradient from finite incoming "
                     f"gradients, in float64 too: {fn} has a pole at the op's input (sqrt or "
                     "a norm at 0, log or a division at 0); " + DO["backward_pole"]
                     + (DO["sqrt_pole"] if name == "sqrt" and at_pole == "0" else ""))
    # a custom Function's name says nothing of its derivative: its backward's own op does
    pole = bool(name and domains.derivative_pole(name)) or bool(
        inner and domains.derivative_pole(_name(inner).rstrip("_")))
    if at_pole and pole and underflowed:
        # finite in float64, and the 0 on the pole came from exp/softmax/sigmoid: a positive
        # value rounded to 0 (sqrt(exp(-120)): exp(-120) is 8e-53 in float64), or into the
        # subnormal range, where the derivative 1/x no longer fits (softmax's 1e-40 under log)
        where = ("to 0, the pole where {fn} is infinite" if at_pole == "0" else
                 "below its type's smallest normal number, so near the pole that {fn} is too "
                 "large for " + _type(dtype))
        return Cause("underflow", f"{op} made a non-finite gradient in {_type(dtype)}, finite "
                     f"in float64: the op's input came from {_POSITIVE_OPS} of a finite "
                     "argument, positive in exact arithmetic, and underflowed "
                     + where.format(fn=fn) + "; " + DO["log_space"])
    if at_pole == "0" and pole:
        # finite in float64, so its input is off the pole there: rounding put it on (1 -
        # sigmoid(20) is 0 in float32, 2e-9 in float64), not a gradient too large for the type
        return Cause("precision", f"{op} made a non-finite gradient in {_type(dtype)}, finite "
                     f"in float64: rounding put the op's input on its pole, where {fn} is "
                     "infinite (sqrt, log or a division at 0); " + DO["stable"]
                     + ("; " + DO["root"] if name == "sqrt" else ""))
    return _backward_overflow(op, fn, pole, dtype, underflowed)


def _saved_inf(op: str, name: str | None, saved: str, inner: str | None, still: bool,
               dtype: torch.dtype) -> Cause:
    """Backward node ``op`` (of forward op ``name``) multiplied a +-inf it saved."""
    if inner and (what := inf_arith(inner, "")):  # (the backward's own inf - inf)
        return Cause("invalid", OWN_INF.format(op=op, inner=inner, what=what,
                                               saved=label(saved)))
    if saved == "-inf" and name in LSE_ALL_INF:
        return Cause("invalid", DO[LSE_ALL_INF[name]].format(op=op, name=name))
    if name and not domains.never_a_pole(name):
        # an op with a pole made it (1/0 masked by torch.where): a pole in the forward
        return Cause("invalid", f"{op} multiplied a {label(saved)} it saved in the "
                     f"forward: {name} at its pole, in a branch masked before the output; "
                     + DO["backward_pole"])
    # no pole: the forward overflowed there and masked or saturated the infinity before
    # anything checked it; the derivative multiplies it (by 0: NaN)
    what = (f"{op} multiplied a {label(saved)} it saved in the forward, where a value "
            f"overflowed and was masked or saturated before the output ({DO['masked']})")
    if still:
        return Cause("overflow", f"{what}; float64 overflows too: " + DO["clamp"])
    return Cause("overflow", f"{what}; float64 holds it: " + _wider(dtype))


def _at_tie(op: str, gap: tuple[str, str], still: bool, dtype: torch.dtype) -> Cause:
    """A decomposition's gradient at its pole: two equal values, a 0 on R's diagonal, exactly
    (non-finite in float64 too) or to the type's precision (see ``factors.at_tie``)."""
    too = "in float64 too" if still else (
        f"in {_type(dtype)}; in float64 only as the reciprocal of rounding noise, the values "
        f"being at its pole to {_type(dtype)}'s precision")
    return Cause("invalid", f"{op} made a non-finite gradient from finite incoming gradients, "
                 f"{too}: {gap[0]}; " + DO[gap[1]])


def _backward_overflow(op: str, fn: str, pole: bool, dtype: torch.dtype,
                       from_exp: bool = False) -> Cause:
    """A gradient too large for its type, finite in float64; ``from_exp``: the op's input
    came from exp (a plain-domain Sinkhorn's ``K @ v``), tiny rather than clamped."""
    # (float16's range, not float32's, was exceeded: autocast's or a .half() model's)
    half = DO["pole_half"] if torch.finfo(dtype).max < torch.finfo(torch.float32).max / 2 else ""
    if pole and from_exp:
        return Cause("overflow", NEAR_POLE_EXP.format(op=op, dtype=_type(dtype), fn=fn) + half)
    if pole:  # off the pole but near it: 1/y² of a division by an eps floor of 1e-30
        return Cause("overflow", f"{op}'s gradient is too large for {_type(dtype)} and finite "
                     f"in float64: {fn} grows without bound near its pole (1/y² for a "
                     "division by y), and the op's input is close to it, though not on it "
                     "(a denominator clamped to a tiny eps); " + DO["near_pole"] + half)
    return Cause("overflow", f"{op}'s gradient is too large for its dtype and finite in "
                 "float64: " + _wider(dtype))
