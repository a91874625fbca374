"""An overflow whose samples are out of scale in one feature of a table of records, not in
their largest value.

:mod:`replay.outliers` compares each sample's largest magnitude with every other sample's:
in a ``(B, F)`` table of features of different scales (a flow record's byte counts beside its
rate in bytes per second, which is larger in every record) the largest value of every row is
the same wide column, and a bulk transfer's byte count 1e5 times the others' stands out in its
own column only. Compared column by column, the samples named and the feature are found
(:func:`replay.outliers.outlier_column`, there since the row check's fallback to several
rows out of scale alike asks it first); this module says it.
"""

from __future__ import annotations

from typing import Any

from .domains import g
from .outliers import outlier_column

__all__ = ["outlier_column", "outlier_column_hint"]

SHOWN = 8  # features named


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
