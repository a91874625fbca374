"""The rows of an op's NaN when the op was given infinities and passed some on: a
``log_softmax`` over slots whose inactive slots' logits are filled ``-inf`` keeps that ``-inf``
in every row and makes NaN only in a row whose every slot is masked; that row, not every row
holding an infinity, is the NaN's sample.
"""

from __future__ import annotations

import math

import torch


def _marks(outs: list[torch.Tensor], only_nan: bool) -> list[torch.Tensor]:
    """Copies of ``outs``: NaN where each holds a NaN (``only_nan``) or any non-finite value,
    0 elsewhere."""
    return [torch.zeros(t.shape, device=t.device).masked_fill_(
        t.isnan() if only_nan else ~t.isfinite(), math.nan) for t in outs]


def nan_rows(batch_rows, outs: list[torch.Tensor], rows: list[int] | None) -> list[int] | None:
    """``rows`` (``batch_rows(outs)``: every row holding a non-finite value) narrowed to those
    holding a NaN. The marks are new tensors that the finder's tracking (reordered, moved
    samples) does not know, so they are read only where their non-finite rows are ``rows``:
    the same row space."""
    if not rows or any(t.is_complex() for t in outs):
        return rows
    if batch_rows(_marks(outs, only_nan=False)) != rows:
        return rows
    return batch_rows(_marks(outs, only_nan=True)) or rows
