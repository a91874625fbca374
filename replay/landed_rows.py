"""The samples of an origin whose output has no rows of the batch's, named where its
non-finite values are next written into a value that has them.

Lift-Splat-Shoot's and BEVDet's voxel pooling flattens the frustum points of every sample into
one list ``(B * N * D * H * W, C)``, keeps those inside the grid, sorts them by voxel rank (the
sample's index one key of it) and pools them with the cumsum trick: an op on the pooled voxels
``(P, C)`` (the log of a voxel's depth mass) runs over the whole batch's voxels, rows that are
no samples, and the model's output, after a BatchNorm over the batch, is non-finite in every
sample: the report named them all. The scatter into the BEV canvas ``(B, C, X, Y)`` that
follows puts each voxel back in its sample, and its non-finite rows are the origin's samples.
So, while the origin has no rows, the ops of the origin's module call that take a non-finite
value are followed until one's output has the batch's samples and holds a non-finite value:
its non-finite rows are the origin's (narrowed further only by the caller, which keeps them
where they are among the call's non-finite samples). A value pooled over the batch (a
batch-wise statistic, :mod:`replay.pooled`) is no sample's: broadcast back into the batch it
is in every row, and nothing is named from it.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from recorder.finite import finite

_STATE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # finder -> (hit, settled)


def land_rows(f: Any, leaves: list, outs: list[torch.Tensor]) -> None:
    """After an op (``leaves``: its arguments; ``outs``: its floating outputs) that an
    :class:`~replay.ops.OpFinder` ``f`` saw: set the rows of its forward origin ``f.first``
    (see the module) where they are none yet and this op lands its non-finite values."""
    hit = f.first
    if hit is None or hit.rows or hit.intentional or not hit.inputs_finite \
            or not (f.samples and f.samples.size) or f.where != hit.within:
        return
    state = _STATE.get(f)
    if state is not None and state[0] is hit and state[1]:
        return
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    if all(map(f.held, tensors)):  # (made of the weights alone: its dims may match the
        return  # batch's by chance, a mesh's (E, 4) edge features)
    bad = [t for t in tensors if t.is_floating_point() and not t.is_complex() and not finite(t)]
    if not bad or all(finite(t) for t in outs):
        _STATE[f] = (hit, False)
        return
    if any(t in f.pooled for t in bad):  # (a batch-wise statistic: no sample's)
        _STATE[f] = (hit, True)
        return
    rows = f.batch_rows(outs)
    if rows is None:  # (still no samples' rows: followed on)
        _STATE[f] = (hit, False)
        return
    _STATE[f] = (hit, True)
    if rows and len(rows) < f.samples.size:
        hit.rows = rows
