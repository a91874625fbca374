"""A backward origin at ``x ** p`` with ``0 < p < 1`` whose input holds exact zeros: the
derivative ``p * x ** (p - 1)`` is infinite at 0, where the value itself is finite and
nothing was masked. EQL's L_1/2 sparsity penalty ``sum(|w| ** 0.5)`` after its trimming phase
set small weights to exactly 0 is the common case; the generic pole advice ("a forward that
masks the value out ... torch.where(mask, x, 1)") describes a masked branch there is none of."""

from __future__ import annotations

import torch

from . import lost_eps
from .cause_result import Cause
from .compat import saved_value
from .positive import node_op
from .rounded_bound import RoundedBound

# ops that leave a parameter's entries as they are (up to sign): |w| is still the weights
_AS_IS = {"Abs", "Neg", "View", "Reshape", "Alias", "T", "Transpose", "Permute", "Expand",
          "Select", "Slice", "Unsqueeze", "Squeeze", "Clone", "Flatten"}


def _of_parameter(fn, depth: int = 6) -> bool:
    """Whether autograd node ``fn`` is a leaf (a parameter) or such an op of one."""
    for _ in range(depth):
        if fn is None:
            return False
        if hasattr(fn, "variable"):  # AccumulateGrad: the leaf itself
            return True
        if node_op(fn) not in _AS_IS:
            return False
        fn = fn.next_functions[0][0] if fn.next_functions else None
    return False


def fractional_power_at_zero(node) -> tuple[float, int, bool] | None:
    """(the exponent, how many entries of the base are exactly 0, whether the base is a
    parameter's entries) for ``node``, a scalar power's backward (``PowBackward0``) with an
    exponent strictly between 0 and 1 and a base holding exact zeros; else None."""
    try:
        if node_op(node) != "Pow":
            return None
        p, base = saved_value(node, "exponent"), saved_value(node, "self")
    except Exception:  # (a freed node: unknown)
        return None
    if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0 < p < 1 \
            or not isinstance(base, torch.Tensor):
        return None
    zeros = int((base == 0).sum())
    try:
        weights = _of_parameter(node.next_functions[0][0])
    except Exception:  # (a node that cannot say)
        weights = False
    return (float(p), zeros, weights) if zeros else None


def fractional_power_hint(b, cause: Cause) -> str:
    """``cause``'s hint for backward origin ``b`` at such a power (see
    :func:`fractional_power_at_zero`), whose zeros are exact or made by rounding."""
    if cause.name not in ("invalid", "precision") or b.fractional_power is None:
        return cause.hint
    p, zeros, weights = b.fractional_power
    said = (f"{b.node}: x ** {p:g} has an infinite derivative at x = 0, and its base holds "
            f"{zeros} exact 0(s)")
    eps = b.lost_eps  # ("take (x + eps) ** p" to code that adds one: it is 0, or float16's 0)
    if not weights and eps is not None and b.dtype is not None \
            and not isinstance(eps, RoundedBound):
        return said + lost_eps.said(eps, b.dtype)
    if cause.name == "precision":  # the generic rounding advice (torch.var, logsigmoid) misleads
        return (said + " that rounding made, positive in float64 (1 - p of a probability "
                "rounded to 1: a focal loss's (1 - p) ** gamma with gamma < 1): floor the base "
                "before the power, x.clamp_min(eps) ** p or (x + eps) ** p")
    if not weights:
        return said + ": take (x + eps) ** p, or leave the zeros out before the power"
    return (said + ", entries of a parameter: weights at exactly 0, which pruning or a "
            "trimming phase leaves, sit on that pole (an L_1/2 penalty sum(|w| ** 0.5)). Leave "
            "the zeros out of the term (keep the pruning mask and take the power of the kept "
            "entries only), smooth it near 0 (a polynomial below a threshold, as smoothed "
            "L_1/2 does) or take (|w| + eps) ** p")
