"""A backward product that overflowed because the forward saved a huge factor an exponential
made: NALU's ``g * a + (1 - g) * m`` with ``m = exp(W @ log|x|)`` at 1e32 and the gate at
exactly 1. The forward is finite (``0 * 1e32``), but ``MulBackward0`` sends ``grad * m`` to
the gate, past float32's range. The generic overflow advice (rescale the inputs, float64)
misses the fix the forward overflow of the same exp gets: bound the learned exponent (iNALU
clips it at 20)."""

from __future__ import annotations

import math

import torch

from .cause_result import Cause
from .compat import saved_value
from .domains import g_pair
from .positive import made_positive, node_op

# a product's backward: the gradient into one factor is the incoming one times the other
_OTHER = {"Mul": ("other", "self")}


def huge_exp_factor(node) -> float | None:
    """The largest magnitude of a factor ``node`` (a product's backward) saved that an
    exponential made, when beyond the square root of its type's largest value (so that a
    gradient of that size times it overflows); else None."""
    try:
        names = _OTHER.get(node_op(node))
        if names is None:
            return None
        for (fn, _), name in zip(node.next_functions, names[::-1]):
            t = saved_value(node, name)
            if fn is None or not isinstance(t, torch.Tensor) or not t.is_floating_point() \
                    or not t.numel() or not made_positive(fn):
                continue
            big = float(t.abs().max())
            if math.isfinite(big) and big > math.sqrt(torch.finfo(t.dtype).max):
                return big
    except Exception:  # (a freed node, a checkpointed one: unknown)
        return None
    return None


def exp_factor_hint(b, cause: Cause) -> str:
    """``cause``'s hint for backward origin ``b`` when its product's saved factor from an
    exponential is that large (see :func:`huge_exp_factor`)."""
    if cause.name != "overflow" or b.exp_factor is None or b.dtype is None:
        return cause.hint
    big, top = g_pair(b.exp_factor, torch.finfo(b.dtype).max)
    return (f"{b.node} multiplied the incoming gradient by a factor an exponential made in the "
            f"forward (up to {big}), and the product went past "
            f"{str(b.dtype).removeprefix('torch.')}'s largest value {top}: bound the exponent "
            "(s.clamp(max=...), as iNALU clips W @ log|x|, or scale * tanh(s)) or rescale the "
            "values it is computed from")
