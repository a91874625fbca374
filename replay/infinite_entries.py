"""A batch tensor of records by features ``(B, F)`` holding +-Inf (no NaN) at a few entries of
some records, in a few of its features, finite everywhere else: a ratio the export computed
with a zero denominator (a flow's ``bytes / duration`` rate for a zero-duration flow, as
CIC-IDS2017's CSVs hold ``Infinity`` in ``Flow Bytes/s``; a per-second count, a percentage of a
total of 0). Not a broken record to filter nor missing values to impute (NaN: see
:mod:`replay.missing_entries`): the fix is that ratio, where the data is made.
"""

from __future__ import annotations

import torch

from .missing_entries import entries_where

__all__ = ["INFINITE_ENTRIES", "infinite_entries"]

INFINITE_ENTRIES = (
    "the batch itself holds Inf and no NaN, and {tensor} holds it at a few features of records "
    "otherwise finite: {where}: a ratio the data pipeline or the export computed with a "
    "denominator of 0 (a rate bytes / duration of a zero-duration flow: CIC-IDS2017's "
    "'Infinity' in Flow Bytes/s; a per-second count; a share of a total of 0); fix it where "
    "the data is made: floor the denominator (duration.clip(lower=eps)), or replace the "
    "infinities (df.replace([np.inf, -np.inf], np.nan)) and impute them (the feature's finite "
    "maximum over the training set, with a flag column) or drop those records, before any "
    "statistic of the column (a mean or std over it is then Inf or NaN too)")


def infinite_entries(t: torch.Tensor | None, d: int | None) -> str:
    """Where ``t``'s infinities lie, as text, when ``t`` is ``(B, F)`` with its samples in dim
    0, every non-finite value +-Inf, in fewer than half of its features and of each record's
    features; else ""."""
    if t is None or d != 0 or t.dim() != 2 or t.shape[1] < 2 or not t.is_floating_point():
        return ""
    x = t.detach()
    inf = torch.isinf(x)
    if not bool(inf.any()) or bool(torch.isnan(x).any()):
        return ""
    cols = inf.any(0)
    if 2 * int(cols.sum()) >= t.shape[1]:
        return ""
    return entries_where(inf)
