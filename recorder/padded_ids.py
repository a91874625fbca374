"""Token ids padded with 0: a ``(B, T)`` integer batch per sample, whatever ``T`` is.

A batch of as many captions as tokens per caption, ``(8, 8)`` beside ``(8, 3, 8, 8)`` images,
has the shape of a field every sample shares (an ``(H, W)`` land-sea mask) and of a pairwise
``(B, B)`` matrix; its rows are the samples' sequences, each its tokens then its padding.
"""

from __future__ import annotations

import torch


def padded_ids(t: torch.Tensor) -> bool:
    """An integer ``(B, T)`` tensor of ids (some above 1: not a 0/1 mask) whose every row's
    nonzero tokens come first (right padding with 0), or every row's last (left padding)."""
    if t.dim() != 2 or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool \
            or t.is_sparse or t.numel() == 0 or int(t.max()) <= 1:
        return False
    steps = (t != 0).to(torch.int8).diff(dim=1)
    return bool((steps <= 0).all()) or bool((steps >= 0).all())
