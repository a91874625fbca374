"""What the float64 re-run widens: floating values to float64 and complex ones to complex128
(a spectral layer's complex weights, an FFT's output), so a model that mixes them runs in one
precision instead of failing on mixed types (``einsum`` of complex128 with complex64)."""

from __future__ import annotations

import torch

from .compat import takes_dtype, tree_map

_HALF_TO_FLOAT = {"_softmax", "_log_softmax"}
# ops that only draw random numbers (not seeded ops that compute, as SDPA with dropout does,
# which must compute in float64): drawn in the step's own type, see draw_as_recorded
DRAWS = frozenset({"randn", "rand", "randn_like", "rand_like", "normal", "normal_", "uniform_",
                   "bernoulli", "bernoulli_", "exponential_", "cauchy_", "log_normal_",
                   "geometric_"})
# random factories whose values take the default dtype (randint's and randperm's do not)
_FLOAT_FACTORIES = {"randn", "rand", "normal"}


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


def draw_as_recorded(func, args, kwargs, dtype: torch.dtype, writes: bool):
    """A random op (``randn_like``, ``rand``, ``normal_``, ``bernoulli_``) run as the recorded
    step ran it: drawn in ``dtype``, the step's own, then widened. A float64 draw takes other
    words from the generator (53 random bits a value, not 24), so it and every later draw of
    the step (the timesteps a diffusion step takes after its noise) would be other numbers,
    and the float64 re-run would answer for another batch. ``writes``: an in-place op, drawn
    into a narrow copy of its first argument, then copied in."""
    wide = widened(dtype)
    kwargs = dict(kwargs or {})
    if func.overloadpacket.__name__ in _FLOAT_FACTORIES and takes_dtype(func) \
            and kwargs.get("dtype") in (None, wide):
        kwargs["dtype"] = dtype  # drawn in the default dtype, float64 in this re-run
    narrow_args, narrow_kwargs = tree_map(
        lambda v: v.to(dtype) if isinstance(v, torch.Tensor) and v.dtype == wide else v,
        (tuple(args), kwargs))
    out = func(*narrow_args, **narrow_kwargs)
    if writes and args and narrow_args[0] is not args[0]:
        return args[0].copy_(narrow_args[0])
    return upcast(out)
