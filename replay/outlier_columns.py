"""An overflow whose samples are out of scale in one feature of a table of records, not in
their largest value.

:mod:`replay.outliers` compares each sample's largest magnitude with every other sample's:
in a ``(B, F)`` table of features of different scales (a flow record's byte counts beside its
rate in bytes per second, which is larger in every record) the largest value of every row is
the same wide column, and a bulk transfer's byte count 1e5 times the others' stands out in its
own column only. Compared column by column, the samples named and the feature are found.
"""

from __future__ import annotations

from typing import Any

import torch

from .domains import g
from .load import Step
from .outliers import FACTOR, row_values

__all__ = ["outlier_column", "outlier_column_hint"]

SHOWN = 8  # features named


def outlier_column(step: Step, mb: int, rows: list[int], factor: float = FACTOR
                   ) -> dict[str, Any] | None:
    """The first 2-D ``(B, F)`` floating tensor of micro-batch ``mb`` with features where the
    largest magnitude in ``rows`` is ``factor`` times that of every other row, nonzero there:
    ``{"tensor", "cols", "col", "value", "others", "positive"}`` (the feature that stands out
    most, its magnitudes, whether that feature is never negative); None when there is none."""
    if not rows:
        return None
    for key, name, _missing, v in row_values(step, mb):
        t = step.tensors[key]
        if t.dim() != 2 or t.shape[1] < 2 or max(rows) >= v.shape[0] or len(rows) >= v.shape[0]:
            continue
        a = torch.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0).abs()
        mask = torch.zeros(v.shape[0], dtype=torch.bool)
        mask[rows] = True
        top, others = a[mask].amax(0), a[~mask].amax(0)
        hit = (others > 0) & (top > factor * others)
        if not bool(hit.any()):
            continue
        ratio = torch.where(hit, top / others.clamp_min(1e-300), 0.0)
        j = int(ratio.argmax())
        return {"tensor": name, "cols": hit.nonzero().flatten().tolist(), "col": j,
                "value": float(top[j]), "others": float(others[j]),
                "positive": bool((torch.nan_to_num(v[:, j], nan=0.0) >= 0).all())}
    return None


def outlier_column_hint(found: dict[str, Any], rows: list[int]) -> str:
    """The sentence an overflow's hint gains when its samples stand out in some features."""
    cols = found["cols"]
    shown = ", ".join(map(str, cols[:SHOWN])) + (f" (+{len(cols) - SHOWN})"
                                                 if len(cols) > SHOWN else "")
    heavy = ("; the feature is never negative: a heavy-tailed count or size (a bulk "
             "transfer's bytes among short flows, a file size, a duration) spans decades in "
             "sound records too, so compress it before it is scaled (log1p, then the z-score "
             "with the training set's statistics of the logs) or clip it at a quantile of the "
             "training set" if found["positive"] else "")
    return (f"sample(s) {','.join(map(str, rows))} of {found['tensor']} stand out in "
            f"feature(s) {shown} (of a table whose features differ in scale, so not in its "
            f"rows' largest values): feature {found['col']} reaches {g(found['value'])}, "
            f"{g(found['value'] / found['others'])}x every other row's largest "
            f"{g(found['others'])} there, which a wider type would only hide{heavy}; a "
            "record in another unit or a corrupt one: fix or filter it where the data is made")
