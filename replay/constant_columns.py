"""Features constant in the batch as given, where a per-feature statistic was 0.

Standardising each column over the minibatch, ``(x - x.mean(0)) / x.std(0)``, divides 0 by 0
in a column whose values are all equal: a gene no cell of the batch expresses, a sensor stuck
at one reading, a one-hot category absent from the batch; over ``(B, T, neurons)`` too, every
bin a row (a neuron's counts over its mean rate in the batch, silent in every trial). ``replay.domains`` says the divisor
was a statistic over the batch, 0 in those columns, and suggests a unit of the model that
stopped varying; when the root input itself holds those columns constant, the data is why,
and the hint says so and names it.
"""

from __future__ import annotations

import re
from typing import Any

from .domains import g
from .empty_counts import root_inputs
from .load import Step

_COLUMNS = re.compile(r"in the same column\(s\) \[([\d, ]+)\] of every one of the (\d+) rows")


def constant_columns_hint(report: dict[str, Any], step: Step) -> None:
    """Append the root inputs whose named columns hold one value in every row."""
    o, hint = report.get("origin") or {}, report.get("hint") or ""
    found = _COLUMNS.search(hint)
    if report.get("cause") != "invalid" or found is None:
        return
    cols, n = [int(c) for c in found.group(1).split(",")], int(found.group(2))
    for name, t, d in root_inputs(step, o.get("micro_batch") or 0):
        if t.dim() < 2 or d != 0 or t.numel() // max(t.shape[-1], 1) != n \
                or max(cols) >= t.shape[-1]:
            continue  # (rows: every leading position, a trial's time bins too)
        x = t.detach().reshape(n, t.shape[-1])[:, cols]
        if bool((x == x[:1]).all()):
            values = sorted({g(float(v)) for v in x[0].tolist()})
            report["hint"] = (
                f"{hint}. The data is why: column(s) {', '.join(map(str, cols))} of {name} "
                f"hold {' / '.join(values)} in every row of the batch as given, a feature "
                "that does not vary in it (a gene no cell of the batch expresses, a sensor "
                "stuck at one reading, a neuron silent in every trial of the batch), so no "
                "model unit is to blame; drop such features where the data is made (genes "
                "expressed in no cell, units lost after spike sorting), take the statistics "
                "over the whole dataset, or add the eps")
            return
