"""What the float64 re-run widens: floating values to float64 and complex ones to complex128
(a spectral layer's complex weights, an FFT's output), so a model that mixes them runs in one
precision instead of failing on mixed types (``einsum`` of complex128 with complex64)."""

from __future__ import annotations

import torch

from .compat import tree_map

_HALF_TO_FLOAT = {"_softmax", "_log_softmax"}


def widened(dtype: torch.dtype) -> torch.dtype | None:
    """float64 for a narrower floating type, complex128 for a narrower complex one, else None
    (already wide, or neither)."""
    if dtype.is_complex:
        return torch.complex128 if dtype != torch.complex128 else None
    return torch.float64 if dtype.is_floating_point and dtype != torch.float64 else None


def upcast(obj):
    """Floating and complex tensors in ``obj`` (an op's arguments, a batch) widened."""
    return tree_map(lambda v: v.to(wide) if isinstance(v, torch.Tensor)
                    and (wide := widened(v.dtype)) is not None else v, obj)


def as_float64(func, args, kwargs):
    """``func``'s arguments with a floating or complex ``dtype=`` (and softmax's half-to-float
    flag) widened: the op then computes, and returns, float64 (complex128)."""
    kwargs = dict(kwargs or {})
    if func.overloadpacket.__name__ in _HALF_TO_FLOAT and len(args) > 2:
        args = (*args[:2], False, *args[3:])
    dt = kwargs.get("dtype")
    if isinstance(dt, torch.dtype) and (wide := widened(dt)) is not None:
        kwargs["dtype"] = wide
    return args, kwargs
