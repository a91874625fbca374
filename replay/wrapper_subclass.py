"""Tensor subclasses with their own ``__torch_dispatch__`` (``_make_wrapper_subclass``: torchao's
NF4 and quantized weights, DTensor, ``torch.masked``'s MaskedTensor, a user's logging wrapper).

The replay's dispatch modes read values (``aminmax(...).tolist()``, clones, float64 casts),
which such a wrapper refuses or answers with another wrapper. A mode given one returns
``NotImplemented`` (:func:`passes_to_subclass`): torch then runs the subclass's own dispatch
with the mode still on, and the mode sees the plain tensors that dispatch computes on (a
dequantized weight's ``mm``, the inner ``div``), the step's real arithmetic.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["passes_to_subclass"]

# (nn.Parameter's and a __torch_function__-only subclass's: torch's own kernels run them)
_PLAIN = torch.Tensor.__torch_dispatch__


def passes_to_subclass(types) -> bool:
    """An aten call's argument ``types`` (a mode's ``__torch_dispatch__`` is handed the
    classes of its tensor arguments that dispatch themselves) hold such a class: the mode
    leaves the call to it. Not torch's jagged nested tensor: the modes take its ops as they
    come (per sequence: replay.strided_nested, replay.nested_lengths), not its flat values'."""
    return any(getattr(c, "__torch_dispatch__", _PLAIN) is not _PLAIN
               and not issubclass(c, _jagged()) for c in types)


@functools.cache
def _jagged() -> type:
    """The class of a jagged nested tensor (its module is torch's private one: asked of an
    instance instead)."""
    return type(torch.nested.as_nested_tensor([torch.zeros(1, 1)], layout=torch.jagged))
