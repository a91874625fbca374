"""Samples out of scale only because a column in another unit is 0 in the other records.

A table's column of int64 nanosecond timestamps (1.7e18) whose missing entries were filled
with 0 makes the records that hold a timestamp stand 1e17x above the others
(:mod:`replay.outliers`): "records out of scale, fix or filter them" would drop every record
that has the feature. They are no corrupt records: in that column they hold values alike
(within :data:`replay.outliers.FACTOR` of each other) and every other record holds exactly 0
there, an absent or filled value. The column's unit is the fault: the hint says to standardise
it (with the zeros as missing values, not as a scale's floor).
"""

from __future__ import annotations

from typing import Any

import torch

from .domains import g
from .load import Step
from .outliers import FACTOR, row_values


def zero_filled_column(step: Step, mb: int, key: str, rows: list[int]
                       ) -> dict[str, Any] | None:
    """``{"cols", "low", "high", "tensor"}`` when ``rows`` of the batch tensor ``key`` (found
    out of scale) stand out in columns where every other row holds 0 and ``rows`` hold values
    within ``FACTOR`` of each other, ``FACTOR`` times the other columns' largest value in those
    rows; None otherwise (one record, or rows out of scale in every column)."""
    if len(rows) < 2:
        return None
    for k, name, _, v in row_values(step, mb):
        if k != key or max(rows) >= v.shape[0] or len(rows) >= v.shape[0] or v.shape[1] < 2:
            continue
        mask = torch.zeros(v.shape[0], dtype=torch.bool)
        mask[rows] = True
        named, others = v[mask].abs(), v[~mask]
        if not bool(torch.isfinite(named).all()):
            return None
        zero_else = (others == 0).all(0)
        low, high = named.amin(0), named.amax(0)
        cols = (zero_else & (low > 0) & (high <= FACTOR * low)).nonzero().flatten().tolist()
        rest = [j for j in range(v.shape[1]) if j not in cols]
        if not cols or not rest:
            return None
        if float(low[cols].min()) <= FACTOR * float(named[:, rest].max()):
            return None
        return {"cols": cols, "low": float(low[cols].min()), "high": float(high[cols].max()),
                "tensor": name}
    return None


def zero_filled_column_hint(found: dict[str, Any], rows: list[int]) -> str:
    """The sentence an overflow's hint gains instead of the records' (:func:`outlier_hint`)."""
    cols = ", ".join(map(str, found["cols"]))
    low, high = g(found["low"]), g(found["high"])
    span = low if low == high else f"{low} to {high}"
    return (f"sample(s) {','.join(map(str, rows))} of {found['tensor']} stand out only in "
            f"column(s) {cols}, where they hold {span} and "
            "every other sample holds 0: no corrupt records, but a feature in another unit "
            "(a datetime as int64 nanoseconds, an amount in cents) that is 0 where it is "
            "absent or was filled; standardise that column before fitting (the training "
            "set's (x - mean) / std over the records that hold it, a missing-indicator for "
            "the filled ones) rather than drop these samples or only lower the learning rate")
