"""What a wider type means for an op whose result is too large for its own: float32 from a
half type, else rescaling or float64, bounding the exponent of an exponential (read by
:mod:`replay.cause` and :mod:`replay.backward_cause`); the op and type names their hints use."""

from __future__ import annotations

import math

import torch

from .cause_text import DO
from .float8_cast import float8_cast_advice
from .operator_power import operator_power_advice
from .ops import Evidence
from .power_overflow import power_advice


def op_name(op: str) -> str:
    return op.removeprefix("aten.")


def type_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def wider(dtype: torch.dtype, op: str | None = None, ev: Evidence | None = None) -> str:
    """What a wider type means from ``dtype``: float32 for float16 (and the 8-bit types), else
    rescaling or float64 (and, for an exponential ``op`` or a product with a huge factor an
    exponential made, bounding its exponent): bfloat16 has float32's range, so what overflows
    it overflows float32 too."""
    if torch.finfo(dtype).max < torch.finfo(torch.float32).max / 2:  # (a float8 cast: its own)
        return float8_cast_advice(op, dtype) or DO["wider"]
    exp = op is not None and op_name(op) in _EXPONENTIAL or ev is not None and exp_factor(ev)
    return power_advice(op, ev) or operator_power_advice(op, ev) or (
        DO["wider64_exp"] if exp else DO["wider64"])


def exp_factor(ev: Evidence) -> bool:
    """An input of the op that an exponential made (``exp_made``) holds a value beyond the
    square root of the type's largest where the op overflowed: the exponential made the huge
    factor (a flow's coupling ``xb * exp(s)`` with ``s`` unbounded), so bound its exponent."""
    edge = math.sqrt(torch.finfo(ev.dtype).max)
    return any(made and v.numel() and float(v.abs().max()) > edge
               for made, v in zip(ev.exp_made, ev.inputs))


_EXPONENTIAL = {"exp", "exp2", "expm1", "pow"}
