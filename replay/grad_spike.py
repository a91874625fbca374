"""One update whose gradient norm spiked far above the run's, which the weights did not survive.

Exploding gradients are one batch's doing more often than a steady climb: a recurrence over a
long or loud sequence, a deep stack without normalisation on an input off its usual range,
gives a gradient thousands of times the run's; the update taken with it throws the weights
far off and the overflow follows a step or two later. A lower learning rate scales that update
only by its own factor (a tenth of 8000x is still 800x), while clipping the gradient norm
bounds it whatever its size: the growth hint says so, with the step and the factor, instead of
offering either remedy alike.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from .precursors import history

SPIKE = 100.0  # the spike's gradient norm over the median of the steps before it
CALM = 10.0  # every step before it within this factor of the median of those before it
MIN_BEFORE = 3  # steps before the spike the median is taken over


def grad_spike(step) -> dict[str, Any] | None:
    """The first recorded step (after MIN_BEFORE, before the event) whose gradient norm left
    CALM times the median of the steps before it, when it did so by SPIKE times or more and
    neither the weights' norm nor the learning rate had left theirs before (one batch's jump out
    of a calm run; not a divergence that climbed first, 20x at step 21, then 1e4x at step 46,
    nor weights a rate of 50 threw off at the first update): ``{"step", "norm", "median",
    "factor"}``; None otherwise."""
    hist = history(step.meta, step.tensors)
    at = hist.get("event_step")
    steps = [s for s in hist["steps"] if s is not None and at is not None and s < at]
    grads = _departure(steps, hist["grad_norm"])
    if grads is None or grads[2] < SPIKE or not _calm_before(steps, hist["grad_norm"], grads[0]):
        return None
    lrs = [max(row) if isinstance(row, list) and row else row for row in hist["lr"]]
    for series in (hist["param_norm"], hist.get("weight_norm") or [], lrs):
        other = _departure(steps, series)
        if other is not None and other[0] < grads[0]:
            return None
    s, v, factor = grads
    return {"step": s, "norm": v, "median": v / factor, "factor": factor}


def _calm_before(steps: list[int], values: list, at: int) -> bool:
    """The last MIN_BEFORE finite values before step ``at`` lie within CALM of each other (no
    climb the median of a short history hid: 2, 232, 2039 under a rate of 50)."""
    recent = [abs(v) for s, v in zip(steps, values) if s < at and _finite(v)][-MIN_BEFORE:]
    return len(recent) == MIN_BEFORE and min(recent) > 0 and max(recent) <= CALM * min(recent)


def _departure(steps: list[int], values: list) -> tuple[int, float, float] | None:
    """``(step, value, factor)`` of the first of ``steps`` (after MIN_BEFORE finite values)
    whose value is more than CALM times the median of those before it, None if none is."""
    before: list[float] = []
    for s, v in zip(steps, values):
        if not _finite(v):
            continue
        med = statistics.median(before) if len(before) >= MIN_BEFORE else None
        if med is not None and med > 0 and abs(v) > CALM * med:
            return s, float(v), abs(v) / med
        before.append(abs(v))
    return None


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def grad_spike_advice(step, windowed: bool) -> str | None:
    """The growth hint's remedy for :func:`grad_spike`, None without one."""
    found = grad_spike(step)
    if found is None:
        return None
    tries = ("--try clip=1.0 re-runs the window with it" if windowed else
             "record with FlightRecorder(..., rewind=N) so that --try clip=1.0 re-runs the "
             "steps from before it")
    return (f"the gradient norm at step {found['step']} was {found['norm']:.3g}, "
            f"{found['factor']:.3g}x the median {found['median']:.3g} of the steps before, "
            "and the update taken with it threw the weights off: an exploding gradient, one "
            "batch that drove the model far off its usual range (a sequence far longer or "
            "louder than the rest, a record in the wrong unit: fix such data where it is "
            "made); clipping the gradient norm between backward() and step() bounds such an "
            "update whatever its size (torch.nn.utils.clip_grad_norm_(model.parameters(), "
            "max_norm)), while a lower learning rate scales it only by its own factor "
            f"({tries})")
