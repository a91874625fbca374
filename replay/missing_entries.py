"""A batch tensor of records by features ``(B, F)`` holding NaN at a few scattered entries of
some records, finite everywhere else: missing values (a genotype call a VCF writes ``./.``, a
lab test not ordered) that the data pipeline read as NaN and never imputed, or a 0/0 the pipeline computed at those entries (a ratio whose denominator is 0
there). Not a bad record to filter (a whole row, a whole column, a run along a time axis:
``replay.recorded``'s other input hints): the fix is an imputation, or the division's guard,
where the data is made.
"""

from __future__ import annotations

import torch

MISSING_ENTRIES = (
    "the batch itself holds NaN, and {tensor} holds it at scattered entries of records "
    "otherwise finite: {where}: missing values the data pipeline read as NaN and never "
    "imputed (an empty cell, a test not taken), or a 0/0 it computed there (a division by zero: "
    "a mean over no values, a database column all NULL, a target encoding's mean target of a "
    "category absent from the folds it was fitted on; a rate over a zero duration); impute "
    "them where the data is made (the feature's training-set mean, or 0 after standardising, "
    "with a missing-indicator where missingness may carry signal) or guard that division; "
    "where the model imputes them itself, name the input to FlightRecorder(..., "
    "allow_nan=[...])")

SHOWN = 8  # samples, and entries of each, named
NARROWEST = 3  # features: of two, one NaN is half the record's


def missing_entries(t: torch.Tensor | None, d: int | None) -> str:
    """Where ``t``'s NaN lie, as text, when ``t`` is ``(B, F)`` with its samples in dim 0 and
    ``F >= 3`` (a narrow table too: a schema's per-column cell statistics, a NULL column's
    mean), every non-finite value NaN, and each sample that holds one holds it at fewer than
    half its features, not two adjacent ones (a run: ``replay.nan_runs``); else ""."""
    if t is None or d != 0 or t.dim() != 2 or t.shape[1] < NARROWEST \
            or not t.is_floating_point():
        return ""
    nan = torch.isnan(t.detach())
    if not bool(nan.any()) or not bool(torch.isfinite(t[~nan]).all()):
        return ""
    count = nan.sum(1)
    if bool((2 * count >= t.shape[1]).any()) or bool((nan[:, 1:] & nan[:, :-1]).any()):
        return ""
    return entries_where(nan)


def entries_where(at: torch.Tensor) -> str:
    """The samples (rows) of a ``(B, F)`` boolean ``at`` with an entry set, and their features
    set, as text (the first :data:`SHOWN` of each)."""
    count = at.sum(1)
    where = []
    for s in (count > 0).nonzero().flatten().tolist()[:SHOWN]:
        cols = at[s].nonzero().flatten().tolist()
        shown = ", ".join(map(str, cols[:SHOWN])) + (", ..." if len(cols) > SHOWN else "")
        where.append(f"sample {s} at feature(s) {shown} (of {at.shape[1]})")
    more = int((count > 0).sum()) - len(where)
    return "; ".join(where) + (f" (+{more} samples)" if more > 0 else "")
