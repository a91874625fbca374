"""Where the precursors of a rewind window's event began: the first step whose learning rate,
gradient norm, weight norm or loss jumped, or from where it rose at every step
(:func:`precursors_began`, the report's ``window.precursors_began``)."""

from __future__ import annotations

import math
import statistics
from typing import Any

from .precursors import JUMP


def precursors_began(per_step: list[dict[str, Any]], factor: float = JUMP
                     ) -> dict[str, Any] | None:
    """The first step of the window where the trouble shows: a series (learning rate,
    gradient norm, weight norm, loss) at least ``factor`` times the median of its earlier
    values in the window, or one that rose at every step and grew ``factor`` times by the last
    (from where it took up its pace; from the window's first step: it began before it). A
    rise whose first growth shows at or after a jump, or that crept up before it and exploded
    after, is that jump's doing (a learning-rate spike or one bad batch makes the weights
    that follow it grow), so the jump is named."""
    jumps, rises = _added_group_jumps(per_step, factor), []
    for key, name, pairs, group in _series(per_step):
        # a measured series (a norm, the loss) needs two earlier values, as the recorded
        # precursors do: against one, a run already diverging "jumps" at the window's second
        # step by its own pace and hides that it began before the window. A learning rate is
        # set, not measured: one earlier value shows a change.
        for i in range(1 if key == "lr" else 2, len(pairs)):
            base = statistics.median(v for _, v in pairs[:i])
            s1, b = pairs[i]
            if base > 0 and b >= factor * base:
                jumps.append({"step": s1, "kind": f"{key}_jump",
                              "detail": f"the {name} {b:.3g} is {b / base:.3g}x the median "
                                        f"{base:.3g} of the window's steps before",
                              **({} if group is None else {"group": group})})
                break
        start = _steady_rise(pairs, factor)
        if start is not None:
            rises.append((pairs[start + 1][0], _rise(name, key, pairs, start), pairs))
    found = jumps + [r for shows, r, pairs in rises
                     if not any(_jump_did_it(j, shows, r["step"], pairs, factor)
                                for j in jumps)]
    return min(found, key=lambda f: f["step"]) if found else None


def _added_group_jumps(per_step: list[dict[str, Any]], factor: float) -> list[dict[str, Any]]:
    """A parameter group added inside the window (``add_param_group`` for a block unfrozen
    mid-run) whose first rate is ``factor`` times the other groups' median at that step: a
    jump its own series cannot show, having no rate before it. ``before`` is that median, the
    rate a try gives the group back."""
    out = []
    for i, s in enumerate(per_step[1:], 1):
        now, was = s.get("group_lrs") or [], per_step[i - 1].get("group_lrs") or []
        for j in range(len(was), len(now)):
            others = [v for k, v in enumerate(now) if k != j and _rate(v)]
            if _rate(v := now[j]) and others and v >= factor * (m := statistics.median(others)):
                out.append({"step": s["step"], "kind": "lr_jump", "group": j, "before": m,
                            "detail": f"the learning rate (parameter group {j}) {v:.3g}, of a "
                                      f"group added at step {s['step']}, is {v / m:.3g}x the "
                                      f"other groups' median {m:.3g}"})
    return out


def _rate(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v) and v > 0


def _series(per_step: list[dict[str, Any]]
            ) -> list[tuple[str, str, list[tuple[int, float]], int | None]]:
    """``(key, name, [(step, |value|)], parameter group or None)`` of each series, in the order one step makes them (of
    two jumps at one step the first is named: a loss one bad batch blew up, not the gradient
    norm that follows from it); each parameter group's learning rate its own series (a rate
    set wrong for one group, at unfreezing, leaves the first group's as it was)."""
    def finite_of(get) -> list[tuple[int, float]]:
        vals = [(s["step"], get(s)) for s in per_step]
        return [(k, abs(v)) for k, v in vals if isinstance(v, (int, float)) and math.isfinite(v)]

    groups = max((len(s.get("group_lrs") or ()) for s in per_step), default=0)
    lrs = [("lr", f"learning rate (parameter group {j})",
            finite_of(lambda s, j=j: ((s.get("group_lrs") or [])[j:] or [None])[0]), j)
           for j in range(groups)] if groups > 1 else \
        [("lr", "learning rate", finite_of(lambda s: s.get("lr")), None)]
    return lrs + [(key, name, finite_of(lambda s, key=key: s.get(key)), None)
                  for key, name in (("loss", "loss"), ("grad_norm", "gradient norm"),
                                    ("param_norm", "weight norm"))]


def _jump_did_it(jump: dict[str, Any], shows: int, began: int,
                 pairs: list[tuple[int, float]], factor: float) -> bool:
    """A rise is a jump's doing when its first growth shows at or after the jump, or when it
    crept up before the jump and exploded after: weights growing slowly as training does, then
    blown up by a learning rate set 1e5 times higher (for a learning rate, set, not measured:
    a cause, not a symptom, less than ``factor`` before it is creeping) or by one batch whose
    loss jumped (a record in the wrong unit: the rise's pace before it, per step, under half
    its pace from where it began to its last value)."""
    at = jump["step"]
    if at <= shows:
        return True
    before = [v for s, v in pairs if began <= s < at]
    if len(before) < 2:
        return False
    if jump["kind"] == "lr_jump" and before[-1] < factor * before[0]:
        return True
    steps = [s for s, _ in pairs if s >= began]
    pace = math.log(pairs[-1][1] / before[0]) / (len(steps) - 1)
    return math.log(before[-1] / before[0]) / (len(before) - 1) < 0.5 * pace


def _rise(name: str, key: str, pairs: list[tuple[int, float]], start: int) -> dict[str, Any]:
    (s0, a), (s1, b) = pairs[start], pairs[-1]
    if start:  # it took up its pace inside the window: at the step whose value first grew so
        s0, a = pairs[start + 1]
    where = "of the window" if not start else f"from step {s0}"
    return {"step": s0, "kind": f"{key}_rise",
            "detail": f"the {name} rose at every step {where}, {b / a:.3g}x from step {s0} "
                      f"to step {s1} ({a:.3g} -> {b:.3g})"
                      + ("" if start else ": it began before the window")}


def _steady_rise(pairs: list[tuple[int, float]], factor: float) -> int | None:
    """Where a series that rose at every step and grew ``factor`` times began to grow: the
    first step-to-step growth at least half the median one, in log terms (0: it grew at that
    pace from the window's first step, so it began before the window). A series that crept
    up and then exploded (a learning-rate spike inside the window) began where it exploded."""
    if len(pairs) < 3 or pairs[0][1] <= 0 or pairs[-1][1] < factor * pairs[0][1]:
        return None
    if not all(a[1] < b[1] for a, b in zip(pairs, pairs[1:])):
        return None
    logs = [math.log(b[1] / a[1]) for a, b in zip(pairs, pairs[1:])]
    pace = statistics.median(logs)
    return next(i for i, g in enumerate(logs) if g >= 0.5 * pace)
