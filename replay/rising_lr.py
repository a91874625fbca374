"""A learning rate that rose at every recorded step up to the event, by orders of magnitude:
a schedule whose rise never ends.

A warmup written as a ``LambdaLR`` factor (``start ** (1 - step / warmup)``, ``step / warmup``)
without ``min(step, warmup)`` keeps raising the rate past its base value at every step; so does
``ExponentialLR`` with ``gamma > 1``. The weights then grow until an op overflows, and the
growth hint's remedies (a lower base rate, less weight decay, clipping) only move the failure
on: a rate still rising at the event needs its schedule capped. Read from the bundle's ring (the
rate each step ran with), so a run recorded without a rewind window is told too.

A warmup toward a peak set too high (OneCycleLR's ``max_lr=30`` on SGD, skorch's
``LRScheduler(policy=OneCycleLR, step_every="batch")``) is still rising at the event by less
than that; the growth hint's "lower the learning rate" then reads as the optimizer's ``lr``,
which such a schedule sets over: :func:`warming_lr_text` names the schedule's rise and its peak.
"""

from __future__ import annotations

import math
from typing import Any

MIN_RISES = 6  # consecutive steps each with a higher rate than the one before
# the rate at the event against the rate the rise started from: above what a warmup meant to
# end does (from 1e-3 or 1e-4 of the base rate; a linear one grows at most 64x in the ring)
MIN_GROWTH = 1e4


def rising_lr_text(hist: dict[str, Any]) -> str | None:
    """The advice for the first parameter group whose rate rose at each of the last
    MIN_RISES or more recorded steps (up to the event), MIN_GROWTH-fold or more, else None.
    A warmup that ends on time is still rising at an event inside it, but by less."""
    event = hist.get("event_step")
    rows = [(s, row) for s, row in zip(hist.get("steps") or [], hist.get("lr") or [])
            if event is None or s <= event]
    groups = len(rows[0][1]) if rows else 0
    for g in range(groups):
        series = [(s, row[g]) for s, row in rows if math.isfinite(row[g]) and row[g] > 0]
        i = len(series) - 1
        while i > 0 and series[i][0] == series[i - 1][0] + 1 and series[i][1] > series[i - 1][1]:
            i -= 1
        rises = len(series) - 1 - i
        if rises < MIN_RISES:
            continue
        (s0, v0), (s1, v1) = series[i], series[-1]
        if v1 / v0 >= MIN_GROWTH:
            return _text(g, groups, s0, v0, s1, v1, rises)
    return None


WARM_RISES = 3  # consecutive rises up to the event that make a schedule still warming up
WARM_GROWTH = 2.0


def warming_lr_text(hist: dict[str, Any]) -> str | None:
    """The first parameter group's rate rising at each of the last WARM_RISES or more recorded
    steps up to the event, WARM_GROWTH-fold or more (a schedule still warming up when the run
    diverged), said as what to lower; None otherwise."""
    event = hist.get("event_step")
    series = [(s, row[0]) for s, row in zip(hist.get("steps") or [], hist.get("lr") or [])
              if (event is None or s <= event) and row and math.isfinite(row[0]) and row[0] > 0]
    i = len(series) - 1
    while i > 0 and series[i][0] == series[i - 1][0] + 1 and series[i][1] > series[i - 1][1]:
        i -= 1
    (s0, v0), (s1, v1) = series[i] if series else (0, 0.0), series[-1] if series else (0, 0.0)
    if len(series) - 1 - i < WARM_RISES or v1 < WARM_GROWTH * v0:
        return None
    return (f"the rate was rising under a schedule up to the event, from {v0:.4g} at step {s0} "
            f"to {v1:.4g} at step {s1} ({v1 / v0:.3g}x): lower the peak it warms up to "
            "(OneCycleLR's or CyclicLR's max_lr, a warmup's target rate), which the schedule "
            "sets over the optimizer's own lr")


def _text(g: int, groups: int, s0: int, v0: float, s1: int, v1: float, rises: int) -> str:
    which = f" (group {g})" if groups > 1 else ""
    per = (v1 / v0) ** (1.0 / rises)
    return (f"the learning rate{which} rose at each of the {rises} steps from step {s0} to "
            f"step {s1}, about {per:.3g}x per step, to {v1:.4g} ({v1 / v0:.3g}x its {v0:.4g} "
            f"at step {s0}) and was still rising: a schedule whose rise never ends, a warmup "
            "whose factor is not capped at its last step (min(step, warmup_steps) left out of a "
            "LambdaLR's lambda) or ExponentialLR with gamma > 1; cap the schedule at the base "
            "rate, as a lower base rate or clipping only delays this")
