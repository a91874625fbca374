"""A module called again and again on its own output within one forward (a neural ODE's
hand-written RK4 steps, an unrolled recurrence) whose outputs grew call after call until one
overflowed: the integration is unstable. The op that overflowed is only where it ended; the
report says the iterates were diverging, which a wider type only postpones."""

from __future__ import annotations

import math
from typing import Any

from .chain_product import PRODUCT_OPS, RUNNING
from .log_sum_exp import MARK as LOG_SUM_EXP
from .run_result import Call, Run

# (the end of an overflow's hint; a report says it once)
_STEPS = ("take smaller or adaptive solver steps (a smaller "
          "dt, a smaller inference step size; an explicit finite-difference scheme stepping a "
          "wave equation is stable only below its CFL limit, v_max dt / dx ≤ 1/√2 on a 2-D "
          "5-point stencil), bound the dynamics (a tanh or a clamp on the "
          "vector field, spectral normalisation; a fixed-point map must be a contraction: "
          "weight normalisation, a Jacobian penalty) or lower the learning rate that made "
          "them unstable")
_ADVICE = "which a wider type only postpones: " + _STEPS
MIN_CALLS = 8  # earlier calls of the module in the micro-batch: fewer is no recurrence
GROWTH = 100.0  # its last finite output's largest magnitude over its first call's
STEADY = 0.5  # the least share of its calls whose output is no smaller than the one before


def _absmax(c: Call) -> float | None:
    vals = [abs(float(v)) for pair in c.minmax for v in pair]
    return max(vals) if vals and all(math.isfinite(v) for v in vals) else None


def diverging_iterates(run: Run, module: str, call: float, mb: int) -> dict[str, Any] | None:
    """``{"first", "last", "from_call", "to_call"}`` when the origin call ``call`` of
    ``module`` came after at least :data:`MIN_CALLS` finite calls of it in micro-batch ``mb``
    whose largest output magnitude grew :data:`GROWTH`-fold or more, the last the largest,
    and rose from one call to the next at least :data:`STEADY` of the time (a stiff step
    overshoots back and forth as it grows)."""
    before = sorted((c for c in run.calls if c.module == module and c.micro_batch == mb
                     and c.call < call), key=lambda c: c.call)
    sizes = [(c.call, _absmax(c)) for c in before]
    if any(v is None for _, v in sizes):
        return None
    return grew(sizes)


def grew(sizes: list[tuple[int, float]], least: int = MIN_CALLS) -> dict[str, Any] | None:
    """:func:`diverging_iterates`'s test on ``(call or run, largest magnitude)`` pairs, at
    least ``least`` of them."""
    sizes = list(sizes)
    while sizes and sizes[0][1] == 0:  # (a solve from z = 0: its first map of 0 is 0)
        sizes.pop(0)
    if len(sizes) < least or not all(math.isfinite(v) for _, v in sizes):
        return None
    (c0, first), (c1, last) = sizes[0], sizes[-1]
    if first <= 0 or last < GROWTH * first or last < max(v for _, v in sizes):
        return None
    rising = sum(b >= a for (_, a), (_, b) in zip(sizes, sizes[1:]))
    if rising < STEADY * (len(sizes) - 1):
        return None
    return {"first": first, "last": last, "from_call": c0, "to_call": c1}


def _chunk_peaks(sizes: list[float]) -> list[tuple[int, float]]:
    """``(run, largest magnitude)`` of the largest of each of :data:`MIN_CALLS` consecutive
    chunks of runs, the last ending at the last run: a line run once per layer of each
    iteration interleaves a growing sequence with a bounded one (a saturated layer's)."""
    n = len(sizes) // MIN_CALLS
    if n == 0:
        return []
    start = len(sizes) - n * MIN_CALLS
    peaks = []
    for i in range(start, len(sizes), n):
        chunk = sizes[i:i + n]
        j = max(range(n), key=lambda k: chunk[k])
        peaks.append((i + j + 1, chunk[j]))
    return peaks


def add_line_note(report: dict[str, Any], sizes: list[float]) -> dict[str, Any]:
    """The forward report with a note (and, for an overflow, the hint's end) when the origin
    op's line ran in a loop of its module's own code whose values at that line grew run after
    run before the one that overflowed (a predictive coding network's inference loop relaxing
    its latents with too large a step, an unrolled optimiser, a fixed-point iteration written
    inline): no module is called again on its own output there for
    :func:`add_iterates_note` to see."""
    o = report.get("origin") or {}
    d = grew(_chunk_peaks(sizes))
    if d is None or LOG_SUM_EXP in (report.get("hint") or ""):  # (growth it explains)
        return report
    report["problems"].append(
        f"{o.get('op')} at its line grew from {d['first']:.3g} (run {d['from_call']}) to "
        f"{d['last']:.3g} (run {d['to_call']}) within this call of "
        f"{o.get('module') or '<root>'}, run after run: a loop in its own code (an inference "
        "or fixed-point loop, an unrolled optimiser) was diverging")
    if report.get("cause") == "overflow":
        hint = report.get("hint") or ""
        # (the op's own growth said already that a wider type only postpones it: its
        # remedies were an iteration's, this loop's steps add a solver's, said once)
        said = "the iterates of a loop were diverging, which a wider type only postpones" in hint
        report["hint"] = (f"{hint}; {'if ' if said else 'but '}the loop running that line was "
                          "diverging" + (" because it steps dynamics in time: " + _STEPS if said
                                         else f", {_ADVICE}")
                          + (RUNNING if o.get("op") in PRODUCT_OPS else ""))
    return report


def add_iterates_note(report: dict[str, Any], run: Run) -> dict[str, Any]:
    """The forward or backward report with a note (and, for an overflow, the hint's end)
    saying the origin module's repeated calls were diverging, when they were: before the
    origin call, or for a backward origin in the whole forward (a deep-equilibrium layer's
    fixed-point solve growing without bound, whose values its backward then overflowed)."""
    o = report.get("origin") or {}
    backward = o.get("phase") == "backward"
    if not backward and (o.get("phase") != "forward" or o.get("call") is None) \
            or o.get("module") is None:
        return report
    d = diverging_iterates(run, o["module"], math.inf if backward else o["call"],
                           o.get("micro_batch") or 0)
    hint = report.get("hint") or ""
    if d is None or _STEPS in hint or LOG_SUM_EXP in hint:  # (the line's loop said it)
        return report
    name = o["module"] or "<root>"
    where = ("in the forward, and the backward took those values" if backward else
             f"within this forward before call {o['call']} made the value")
    report["problems"].append(
        f"{name}'s output grew from {d['first']:.3g} (call {d['from_call']}) to "
        f"{d['last']:.3g} (call {d['to_call']}) {where}, call after call: as an ODE "
        "solver's steps, a fixed-point solver's iterations or an unrolled recurrence calling "
        "it again on its own output, it was diverging")
    if report.get("cause") == "overflow":
        report["hint"] = (
            f"{report.get('hint') or ''}; but the iterates of {name} were diverging, {_ADVICE}")
    return report
