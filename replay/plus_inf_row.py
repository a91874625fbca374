"""A row reduction's NaN of a +inf it was given, which no mask is.

A softmax (log_softmax, logsumexp) makes NaN of a row whose every entry is -inf, a fully
masked row, and of a row holding +inf: its max shift is inf - inf. Only the first is a mask;
a +inf logit is a -inf fill whose sign an op flipped after it (``-d.masked_fill(m, -inf)``
is ``-(d.masked_fill(...))``) that ``allow_inf`` let the model output hold, or an overflow.
The report said "a row whose every entry is -inf" of rows holding +inf. :func:`row_hint`
tells them apart by the largest value the op was given.
"""

from __future__ import annotations

import math

from .cause_text import DO
from .hits import OpHit

PLUS_INF = ("{op} of a row holding +inf, which no softmax reads as masked (its max shift is "
            "inf - inf): only -inf masks an entry; a +inf logit is a -inf fill whose sign an "
            "op flipped after it (-d.masked_fill(m, -inf) is -(d.masked_fill(m, -inf)): fill "
            "after negating, (-d).masked_fill(m, -inf)), or a value that overflowed (the "
            "chain shows its maker)")


def row_hint(hit: OpHit, name: str) -> str:
    """The hint of row reduction ``name``'s NaN or -inf made from infinities it was given."""
    if hit.input_max is not None and hit.input_max == math.inf:
        return PLUS_INF.format(op=hit.op)
    return (f"{hit.op} of a row whose every entry is -inf (a fully masked row): "
            + DO["masked_row"] + DO["max_shift"] * (name in ("max", "amax")))
