"""A batch tensor holding NaN only where a 0/1 tensor of the same batch marks its values
missing (a sequence's gaps stored as NaN beside its ``observed`` mask): the model computed
with them and masked after (``torch.where(mask, update, prior)`` computes both branches, and
its backward sends 0 * NaN = NaN into the gradients). The fix is in the data: fill the gaps
with a finite value before the model and let the mask select."""

from __future__ import annotations

from typing import Any

import torch

from recorder.finite import zero_one

MASKED_GAPS = (
    "the batch itself holds NaN, and {tensor} holds it only where {mask} marks a value "
    "missing (its {off} entries): missing values stored as NaN that the model computes with "
    "before its mask discards them (torch.where(mask, updated, prior) and a mask multiplied "
    "after both compute the NaN branch, and their backward turns 0 * NaN into NaN gradients); "
    "fill the gaps with a finite value in the data pipeline (x.nan_to_num(0.0), "
    "x.masked_fill(~mask, 0)) and let the mask select, or pass allow_nan=['{tensor}'] to the "
    "recorder if the model fills them itself before any op")


def masked_gaps(t: torch.Tensor | None, tensor: str, others: dict[str, Any]) -> str:
    """The hint when ``t``'s NaN (and only NaN) lie within the entries of one of ``others``
    (name: batch tensor) that are 0/False, or within its 1/True entries where those are not
    the whole tensor (a ``missing`` mask), and that hold NaN at least half of the time: a mask
    of gaps stored as NaN marks mostly NaN, a mask of real entries (a bag's patches beside the
    padding) merely contains a corrupted entry's NaN; "" otherwise."""
    if t is None or not t.is_floating_point() or t.dim() < 2:
        return ""
    bad_all = ~torch.isfinite(t)
    if not bool(bad_all.any()) or not bool(torch.isnan(t)[bad_all].all()):
        return ""
    for name, m in others.items():
        if not isinstance(m, torch.Tensor) or m is t or m.dim() < 2 \
                or tuple(m.shape) != tuple(t.shape[:m.dim()]):
            continue
        if m.dtype != torch.bool and not zero_one(m):
            continue
        bad = bad_all.reshape(*m.shape, -1).any(-1)
        on = m.bool()
        for off, gaps in (("False/0", ~on), ("True/1", on)):
            if bool(gaps.any()) and not bool(gaps.all()) and not bool((bad & ~gaps).any()) \
                    and 2 * int(bad.sum()) >= int(gaps.sum()):
                return MASKED_GAPS.format(tensor=tensor, mask=name, off=off)
    return ""
