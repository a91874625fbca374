"""A product's 0 that is a coefficient, not a mask: ``(self.multipliers * violations).sum()``
with Lagrange multipliers at their start of 0, ``lam * penalty`` with a weight warming up from 0.

A mask selects entries: a tensor of the batch (a visibility, a valid map) or one the code made
of it. A number, a 0-d tensor, or a tensor the loss holds as its state (a buffer, a parameter,
a tensor attribute) that is 0 at every entry switches a whole term off instead: the NaN it met
was made before it by the op the report names, in no entry the loss meant to leave out, and
the mask's advice (make the op safe where the mask is 0, select the weighted entries) does not
apply.
"""

from __future__ import annotations

import torch
from torch import nn

# the sentence a NaN's hint gains in place of the mask's (see replay.masked_after)
ZERO_COEFFICIENT = (
    "; then {op}{at} multiplied that NaN by a coefficient of 0 (a Lagrange multiplier at its "
    "start, a loss weight warming up from 0), which switches the term off but keeps its NaN "
    "(NaN * 0 is NaN): that 0 is no mask, and the NaN is the op's named above: fix it there")


def zero_coefficient(factors: tuple, loss_fn) -> bool:
    """Whether a product that met a NaN with a 0 (its tensor operands ``factors``) took that 0
    as a coefficient: its other operand a number, or a tensor 0 at every entry that is 0-d or
    held by ``loss_fn``."""
    if len(factors) < 2:
        return True
    held = _held(loss_fn)
    return any(t.dim() == 0 or any(_same(t, h) for h in held)
               for t in factors if not bool(t.any()))


def _held(loss_fn) -> list[torch.Tensor]:
    """The tensors a loss module holds: its parameters, buffers and tensor attributes."""
    if not isinstance(loss_fn, nn.Module):
        return []
    tensors = [*loss_fn.parameters(), *loss_fn.buffers()]
    for m in loss_fn.modules():
        tensors += [v for v in vars(m).values() if isinstance(v, torch.Tensor)]
    return tensors


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (a.device == b.device and a.data_ptr() == b.data_ptr()
                      and a.shape == b.shape)
