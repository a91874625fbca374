"""A division in whole columns whose divisor the model made of its buffers alone (a Gaussian
normaliser's ``(x - self.mean) / (self.std + eps)``, with the dataset's std of a joint that
never moves, its eps lost in float16): :mod:`replay.domains` says the divisor was a statistic
over the batch, 0 in those columns, and :mod:`replay.constant_columns` then blames the batch's
constant columns and advises statistics over the whole dataset, which these already are. The
hint names the buffers instead, and (for a 0/0 or x/0 the exact arithmetic makes too) advice for
a statistic the model keeps, not the batch's constant feature.
"""

from __future__ import annotations

import re

from .cause_text import DO
from .domains import BATCH_STATISTIC

__all__ = ["kept_divisor_hint"]

# what to do instead of DO["divide_feature"]'s (a feature constant over the batch, an eps in a
# statistic over it): the statistic is the model's, fitted where it was built
KEPT_ADVICE = ("floor that statistic where it is fitted (std.clamp_min(eps); scikit-learn's "
               "StandardScaler sets a zero scale to 1) or drop the feature constant there (a "
               "variance filter: a flag or counter column that never varies in the training "
               "split)")

_SAID = re.compile(r"in the same column\(s\) (\[[\d, ]+\]) of every one of the (\d+) rows: "
                   + re.escape(BATCH_STATISTIC))


def kept_divisor_hint(hint: str | None, finder, hit) -> str | None:
    """``hint`` with its batch statistic replaced by the buffers the blamed division's divisor
    was made of, when it was made of buffers alone; else ``hint`` as it is."""
    names = finder.names.hit_divisor_kept
    if hint is None or not names or hit is None or hit is not finder.first:
        return hint
    shown = ", ".join(names)
    said = _SAID.sub(
        lambda m: f"at column(s) {m.group(1)} of every one of the {m.group(2)} rows: the "
                  f"divisor was made of the model's buffer{'s' if len(names) > 1 else ''} "
                  f"{shown} alone (a statistic it keeps, fitted on the data or set where it "
                  "was built: not the batch's), 0 there: a feature constant where that "
                  "statistic was computed, every sample divides by it alike, no record is to "
                  "blame", hint, count=1)
    return said if said == hint else said.replace(DO["divide_feature"], KEPT_ADVICE, 1)
