"""A batch tensor holding NaN at scattered entries beside a 0/1 tensor of exactly its shape
that the model takes too (a missingness mask: a probabilistic circuit marginalising the
features it marks, an ``observed`` mask of a clinical series) and that holds at the NaN entries
the value it holds at the observed ones: the values were missing, but the mask that tells the
model so was built without them (from a schema, from another column, all observed), so the
model computes with the NaN instead of marginalising it. The fix is one line where the data is
read: build the mask from the data and fill the entries it marks."""

from __future__ import annotations

from typing import Any

import torch

from recorder.finite import zero_one

from .missing_entries import MISSING_ENTRIES

UNMARKED_MISSING = (
    "the batch itself holds NaN, and {tensor} holds it at scattered entries of records "
    "otherwise finite: {where}; {mask}, the 0/1 tensor of {tensor}'s shape the model takes "
    "beside it (a mask of missing or of observed entries), holds {value} at every one of them, "
    "as at the observed entries: missing values the data pipeline never marked missing, so "
    "the model computes with the NaN instead of masking or marginalising it; build the mask "
    "from the data where it is read (missing = x.isnan(), or observed = ~x.isnan(), combined "
    "with any mask it had) and fill the entries it marks with a finite value "
    "(x.nan_to_num(0.0)), which the mask then discards")


def scattered_missing(t: torch.Tensor, tensor: str, others: dict[str, Any], where: str) -> str:
    """The hint of ``t``'s NaN at scattered entries (``where``, from
    ``replay.missing_entries``): :func:`unmarked_missing`'s when a mask beside it left them
    unmarked, else missing values to impute."""
    return unmarked_missing(t, tensor, others, where) \
        or MISSING_ENTRIES.format(tensor=tensor, where=where)


def unmarked_missing(t: torch.Tensor | None, tensor: str, others: dict[str, Any],
                     where: str) -> str:
    """The hint when one of ``others`` (name: batch tensor) is 0/1 of exactly ``t``'s shape
    and holds one value at all of ``t``'s NaN entries, the value of most of ``t``'s finite
    entries too (the NaN treated as observed); "" otherwise."""
    if t is None or not t.is_floating_point():
        return ""
    nan = torch.isnan(t.detach())
    if not bool(nan.any()):
        return ""
    for name, m in others.items():
        if not isinstance(m, torch.Tensor) or m is t or tuple(m.shape) != tuple(t.shape):
            continue
        if m.dtype != torch.bool and not zero_one(m):
            continue
        on = m.bool()
        at = on[nan]
        if bool(at.all()) or not bool(at.any()):
            value = bool(at[0])
            seen = on[~nan]
            if 2 * int((seen == value).sum()) > seen.numel():
                shown = "True/1" if value else "False/0"
                return UNMARKED_MISSING.format(tensor=tensor, where=where, mask=name,
                                               value=shown)
    return ""
