"""A batch tensor holding NaN at scattered entries beside a 0/1 tensor of exactly its shape
that the model takes too and that holds at the NaN entries the value it holds at most observed
ones. Where it is a missingness mask (a probabilistic circuit marginalising the features it
marks, an ``observed`` mask of a clinical series), the values were missing but the mask that
tells the model so was built without them (from a schema, all observed), so the model computes
with the NaN instead of marginalising it: build the mask from the data and fill the entries it
marks. A 0/1 tensor of another meaning (a table's valid columns) fits the same test, so the
sentence follows the missing-values hint instead of replacing it."""

from __future__ import annotations

from typing import Any

import torch

from recorder.finite import zero_one

from .missing_entries import MISSING_ENTRIES

# said after MISSING_ENTRIES: a 0/1 tensor of the batch tensor's shape may be a mask of missing
# or observed entries (a circuit's), or one of other meaning (a table's valid columns)
UNMARKED_MISSING = (
    "; {mask}, the 0/1 tensor of {tensor}'s shape the model takes beside it, holds {value} at "
    "every one of them, as at most finite entries: where it is a mask of missing or of "
    "observed entries, the data pipeline never marked these missing, so the model computes "
    "with the NaN instead of masking or marginalising it; build the mask from the data where "
    "it is read (missing = x.isnan(), or observed = ~x.isnan(), combined with any mask it "
    "had) and fill the entries it marks with a finite value (x.nan_to_num(0.0)), which the "
    "mask then discards")


def scattered_missing(t: torch.Tensor, tensor: str, others: dict[str, Any], where: str) -> str:
    """The hint of ``t``'s NaN at scattered entries (``where``, from
    ``replay.missing_entries``): missing values to impute, and :func:`unmarked_missing`'s
    sentence when a 0/1 tensor beside it left them unmarked."""
    return MISSING_ENTRIES.format(tensor=tensor, where=where) \
        + unmarked_missing(t, tensor, others)


def unmarked_missing(t: torch.Tensor | None, tensor: str, others: dict[str, Any]) -> str:
    """The sentence when one of ``others`` (name: batch tensor) is 0/1 of exactly ``t``'s shape
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
                return UNMARKED_MISSING.format(tensor=tensor, mask=name, value=shown)
    return ""
