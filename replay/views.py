"""The view of a re-computed model output that the loss was given of the recorded one (its
shape, strides and offset), redone on an output the replay resized (``--try drop=``)."""

from __future__ import annotations

import math

import torch


def same_view(o: torch.Tensor, shape: list[int], stride: list[int], off: int,
               of: list[int] | None = None) -> torch.Tensor:
    """The view of the re-computed output ``o`` that the loss was given of the recorded one
    (``shape``, ``stride``, ``off``; ``of``: the recorded output's shape, absent in older
    bundles). When the replay changed the batch (--try drop=), ``o`` has fewer elements: a
    reshape of the whole output (``logits.view(-1, V)``) or a permutation of its dims
    (``log_probs.transpose(0, 1)`` for ``nn.CTCLoss``) is redone on it; other views, and a
    part of the output (``emb[0]``, which starts at offset 0 too), keep the recorded strides."""
    whole = of is None or math.prod(of) == math.prod(shape)
    if shape and whole and o.numel() != math.prod(shape) and not off and o.is_contiguous():
        if list(stride) == _contiguous_strides(shape):
            return o.reshape(-1, *shape[1:])
        # the view's dims in the output's order: strides descending, contiguous for that shape
        order = sorted(range(len(shape)), key=lambda d: -stride[d])
        base = [shape[d] for d in order]
        if o.dim() == len(shape) and [stride[d] for d in order] == _contiguous_strides(base) \
                and sum(a != b for a, b in zip(o.shape, base)) <= 1:
            return o.permute(sorted(range(len(order)), key=order.__getitem__))
    if of is not None and o.numel() != math.prod(of):
        redone = _resized_view(o, shape, stride, off, of)
        if redone is not None:
            return redone
    return o.as_strided(shape, stride, o.storage_offset() + off)


def _resized_view(o: torch.Tensor, shape: list[int], stride: list[int], off: int,
                  of: list[int]) -> torch.Tensor | None:
    """The recorded view of a contiguous output of shape ``of`` redone on ``o``, the re-run's
    output, whose size differs in one dim (--try drop= removed samples): a column of a
    multi-output head (``out[:, 1]``, a quantile of three: stride 3, offset 1), an expand or
    a transpose's row of it. Each view dim is the output dim of its stride; one spanning the
    resized dim takes its new size. None when the view is not so made (the recorded strides
    are kept)."""
    diff = [d for d in range(len(of)) if o.dim() == len(of) and o.shape[d] != of[d]]
    if len(diff) != 1 or not o.is_contiguous():
        return None
    k, old, new = diff[0], _contiguous_strides(of), _contiguous_strides(list(o.shape))
    dims = {old[d]: d for d in range(len(of)) if of[d] > 1}
    if len(dims) != sum(n > 1 for n in of):  # (two dims of one stride: ambiguous)
        return None
    at = [(off // old[d]) % of[d] if of[d] > 1 else 0 for d in range(len(of))]
    if sum(i * s for i, s in zip(at, old)) != off or at[k] != 0:
        return None
    sizes, strides = [], []
    for n, s in zip(shape, stride):
        d = dims.get(s) if s and n > 1 else None
        if s and n > 1 and (d is None or d == k and n != of[k]):
            return None
        sizes.append(o.shape[k] if d == k else n)
        strides.append(new[d] if d is not None else s)
    return o.as_strided(sizes, strides, o.storage_offset() + sum(
        i * s for i, s in zip(at, new)))


def _contiguous_strides(shape: list[int]) -> list[int]:
    out, n = [], 1
    for size in reversed(shape):
        out.append(n)
        n *= max(size, 1)
    return out[::-1]
