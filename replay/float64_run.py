"""The casts of a float64 re-run (:meth:`replay.rerun.Runner.float64`): the model's and the
loss's own tensors widened in place (their dtypes before, to restore), a micro-batch's
arguments cast as the model takes them, and the default dtype for the tensors its code makes
without one."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from recorder.capture import map_tensors

from .float64 import widened


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype | None):
    """The run's compute type for the tensors the model's code makes without a dtype
    (``torch.zeros(n, d)`` as an ``index_add_`` target), as they had the recorded run's: in a
    float64 run a float32 one would refuse the float64 values added into it."""
    if dtype is None:
        yield
        return
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def loss_own(loss, model: nn.Module, which: str) -> list[tuple[str, torch.Tensor]]:
    """The loss module's named parameters or buffers (``which``) that are not the model's."""
    if not isinstance(loss, nn.Module):
        return []
    model_ids = {id(t) for _, t in [*model.named_parameters(), *model.named_buffers()]}
    return [(n, t) for n, t in getattr(loss, which)() if id(t) not in model_ids]


def to_float64(named, even_float64: bool = False) -> dict[str, torch.dtype]:
    """Widen the floating (and complex) tensors of ``named`` in place (see
    :func:`replay.float64.widened`); their dtypes before."""
    dtypes = {}
    with torch.no_grad():
        for name, t in named:
            wide = widened(t.dtype) or (t.dtype if even_float64 and t.is_floating_point()
                                        else None)
            if wide is not None:
                dtypes[name] = t.dtype
                t.data = t.data.to(wide)
    return dtypes


def cast(obj, dtype, made: dict[str, torch.Tensor] | None = None):
    """``obj`` (a micro-batch's arguments, rebuilt from the bundle) with floating tensors cast
    (and complex ones widened, for float64); ``made``'s tensors (by key) are swapped for their
    casts too, which the model then takes."""
    cast = {}

    def one(v):
        cast[id(v)] = (v.to(dtype) if v.is_floating_point() else
                       v.to(wide) if dtype == torch.float64 and v.is_complex()
                       and (wide := widened(v.dtype)) is not None else v)
        return cast[id(v)]

    obj = map_tensors(obj, one)
    if made is not None:
        made.update({k: cast.get(id(t), t) for k, t in made.items()})
    return obj
