"""The samples of a backward origin whose gradient has the batch flattened with the dimension
after it (an STFT of every channel of every trial, ``x.reshape(B * C, T)``: rows ``(B * C,
...)``, which the shape does not say are samples): the view node that unflattens that gradient
back to ``(B, C, ...)`` later in the backward names them, as rows of the batch's dim 0.

The other way round, rows packed ``k`` samples to a row (PacGAN's critic, and its gradient
penalty's ``grad.reshape(-1, pac * D)``: rows ``(B / k, k * D)``, fewer than the batch's):
the view node that unpacks that gradient back to ``(B, D)`` names the samples of the packs
that were non-finite, where the origin (the penalty's ``sqrt`` of a pack's squared norm of 0)
had rows of no sample's, even in the loss."""

from __future__ import annotations

import torch

from recorder.finite import finite
from recorder.samples import Samples

_VIEWS = {"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0"}


def unflattened_rows(node, grad_inputs, grad_outputs, where: Samples) -> list[int]:
    """The non-finite samples of the gradient ``node`` returned, when ``node`` is a view's
    backward turning rows ``(B * k, ...)`` into ``(B, k, ...)``; [] otherwise."""
    came, back = _view_grads(node, grad_inputs, grad_outputs, where)
    if came is None or came.dim() < 1 or back.dim() < 2:
        return []
    if back.shape[0] != where.size or came.shape[0] != back.shape[0] * back.shape[1] \
            or back.shape[1] < 2 or finite(back):
        return []
    return where.rows(back)


def packed_rows(node, grad_inputs, grad_outputs, where: Samples) -> list[int]:
    """The non-finite samples of the gradient ``node`` returned, when ``node`` is a view's
    backward turning rows ``(B / k, k * D, ...)`` into ``(B, D, ...)`` (k >= 2, in order);
    [] otherwise."""
    came, back = _view_grads(node, grad_inputs, grad_outputs, where)
    if came is None or came.dim() < 2 or back.dim() < 2:
        return []
    k = back.shape[0] // max(came.shape[0], 1)
    if back.shape[0] != where.size or k < 2 or came.shape[0] * k != back.shape[0] \
            or came.shape[1] != k * back.shape[1] or finite(back):
        return []
    return where.rows(back)


def _view_grads(node, grad_inputs, grad_outputs, where: Samples) -> tuple:
    """(the gradient that came into view node ``node``, the one it sent back), both tensors,
    when there are samples to name; (None, None) otherwise."""
    if not where.size or node.name() not in _VIEWS:
        return None, None
    came = next((g for g in grad_outputs if isinstance(g, torch.Tensor)), None)
    back = next((g for g in grad_inputs if isinstance(g, torch.Tensor)), None)
    return (None, None) if came is None or back is None else (came, back)
