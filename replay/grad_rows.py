"""The batch rows (samples) of the gradients a backward node returned: those of the first
non-finite one bound for an activation, never for a parameter (whose gradient is no batch even
where a size matches the batch's) nor for a value that pools the batch."""

from __future__ import annotations

import torch

from recorder.finite import finite
from recorder.samples import Samples

from .pooled import pooled_size


def batch_rows(node, returned: list, where: Samples) -> list[int]:
    """The samples of the first non-finite gradient the node returned for an activation
    (one that has the batch's samples); gradients bound for a parameter (an
    ``AccumulateGrad``) are skipped, as theirs is no batch even when a size matches, and so
    are those for a value that pools the batch (:func:`replay.pooled.pooled_size`)."""
    if not where.size:
        return []
    nexts = list(node.next_functions)
    for i, g in enumerate(returned):
        if not isinstance(g, torch.Tensor) or where.dim(g) is None:
            continue
        target = nexts[i][0] if i < len(nexts) else None
        if _for_parameter(target, g):
            continue
        if not finite(g):
            # (a value pooled over the batch, a batch-wise Dice's per-class sums: no samples)
            if target is not None and (size := pooled_size(target, where)) is not None \
                    and g.numel() <= size:
                continue
            return where.rows(g)
    return []


# nodes that hand a gradient on to their one input only rearranged (F.linear's W.t(), a cast
# of a weight under autocast): no batch is summed there, so a weight's gradient stays one
_LAYOUT = {"T", "Transpose", "Permute", "View", "UnsafeView", "ReshapeAlias", "Squeeze",
           "Unsqueeze", "Alias", "Clone", "ToCopy"}


def _for_parameter(target, grad: torch.Tensor, depth: int = 6) -> bool:
    """Whether a gradient ``grad`` sent to node ``target`` is a parameter's: its
    ``AccumulateGrad``, reached through :data:`_LAYOUT` nodes (a hidden size equal to the
    batch's made the rows of linear's weight gradient, through its TBackward0, read as
    samples) or through one-input ops on the parameter alone that keep its shape (a gain's
    ``sqrt(g.abs())``, ``softplus(raw) + eps``: a gain as wide as the batch read as samples);
    an op with a second input (``x * w``, ``x @ w``) or a broadcast (``w.expand(B, D)``) sends
    the gradient on per sample."""
    transformed = False
    for _ in range(depth):
        if target is None:
            return False
        if type(target).__name__ == "AccumulateGrad":
            return not transformed or grad.shape == target.variable.shape
        name = target.name()
        if name[:name.rfind("Backward")] not in _LAYOUT:
            if len(target.next_functions) != 1:
                return False
            transformed = True
        target = next((f for f, _ in target.next_functions if f is not None), None)
    return False


def node_rows(node, returned: list, where: Samples) -> list[int]:
    """The graphs of the first non-finite gradient ``node`` returned for a value per node of
    the graph batch (:meth:`Samples.per_node`), none bound for a parameter."""
    nexts = list(node.next_functions)
    for i, g in enumerate(returned):
        target = nexts[i][0] if i < len(nexts) else None
        if isinstance(g, torch.Tensor) and where.per_node(g) and not finite(g) \
                and not _for_parameter(target, g):
            return where.rows(g)
    return []


def batch_rows_in(grads, where: Samples) -> list[int]:
    """The samples of the first non-finite gradient among ``grads`` that has the batch's."""
    if not where.size:
        return []
    return next((where.rows(g) for g in grads if isinstance(g, torch.Tensor)
                 and where.dim(g) is not None and not finite(g)), [])
