"""Where a micro-batch's batch tensors sit in a larger batch they are row slices of.

GradCache and its kin (sentence-transformers' cached losses, gradient accumulation by
``x.split(chunk)`` or ``x[begin:end]``) feed the model chunks of one loader batch: a view of it,
``chunk_size`` rows from an offset. The bundle then holds the chunk, whose sample 0 is not the
loader's sample 0: the offset and the whole batch's size let the report name the user's rows.
"""

from __future__ import annotations

from typing import Any

import torch

from .compat import view_base


def sliced_rows(tensors: dict[str, torch.Tensor]) -> dict[str, int] | None:
    """``{"start": k, "of": n}`` when every tensor of a micro-batch's inputs that has rows is
    rows ``k ...`` of an ``n``-row tensor it is a view of (one offset for all); None else."""
    found: set[tuple[int, int]] = set()
    for t in tensors.values():
        if t.dim() == 0:
            continue
        rows = _rows_of(t)
        if rows is None:
            return None
        found.add(rows)
    if len(found) != 1:
        return None
    start, of = found.pop()
    return {"start": start, "of": of}


def _rows_of(t: torch.Tensor) -> tuple[int, int] | None:
    base = view_base(t)
    if base is None or base.dim() != t.dim() or base.shape[1:] != t.shape[1:] \
            or t.stride() != base.stride() or not base.is_contiguous() \
            or base.shape[0] <= t.shape[0] or not base.stride(0):
        return None
    offset, row = t.storage_offset() - base.storage_offset(), base.stride(0)
    if offset < 0 or offset % row:
        return None
    return offset // row, base.shape[0]


def chunk_of(entry: dict[str, Any]) -> tuple[int, int] | None:
    """A bundle's ``rows_of`` entry as (start, of), checked (the replay trusts no shape)."""
    rows = entry.get("rows_of")
    if not isinstance(rows, dict):
        return None
    start, of = rows.get("start"), rows.get("of")
    if type(start) is not int or type(of) is not int or not 0 <= start < of:
        return None
    return start, of
