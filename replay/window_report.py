"""The report's ``window`` part: the bundle's rewind window re-run (``replay.window``), whether it
reaches the recorded event at the recorded step, the first step where anything went
non-finite, and where the precursors began (its words: :mod:`replay.rewind_text`). An optimizer event caught after its update becomes
replayable: the update is re-run from the window and the op that made the value is named.
"""

from __future__ import annotations

from typing import Any

from .findings import UPDATE_NOT_RERUN, finish
from .load import Step
from .origins import optimizer_hint
from .rewind_text import where
from .window import matches_event, precursors_began, run_window, window_of


def add_window(step: Step, report: dict[str, Any]) -> None:
    """Fill ``report["window"]`` (None without a window) and, for an optimizer event, the
    origin from the re-run update."""
    report["window"] = None
    win = window_of(step)
    if win is None or step.model is None:
        return
    res = run_window(step, win)
    o = res.first
    ok = matches_event(step, o)
    first, last = win.records[0]["step"], win.records[-1]["step"]
    report["window"] = {
        "copy_step": win.copy_step, "steps": [first, last], "reproduced": ok,
        "event_step": o.step if o else None,
        "first_non_finite": o.as_json() if o else None,
        "precursors_began": precursors_began(res.per_step),
        "per_step": res.per_step, "loop_clip": win.loop_clip, "loss_factors": win.loss_factors,
    }
    report["problems"] += res.problems
    ev = step.event
    if o is None:
        report["problems"].append(
            f"re-running the window from the copy at step {win.copy_step} reached step {last} "
            "with every value finite: the event does not come back from the window")
    elif not ok:
        report["problems"].append(
            f"re-running the window, the first non-finite value is at step {o.step} "
            f"({where(o.as_json())}), not the recorded {ev.get('phase')} event at step "
            f"{ev.get('step')}")
    if ev.get("phase") == "optimizer" and o is not None and o.phase == "update":
        _optimizer_origin(step, report, o, ok)


def _optimizer_origin(step: Step, report: dict[str, Any], o, ok: bool) -> None:
    report["problems"] = [p for p in report["problems"] if p != UPDATE_NOT_RERUN]
    origin = {**report["origin"], "phase": "optimizer", "params": o.params,
              "param": o.params[0], "op": o.op, "source": o.source, "chain": o.chain,
              "made": o.kind, "step": o.step}
    finish(report, origin, "optimizer", reproduced=ok,
           hint=optimizer_hint(step, o.op, o.kind, o.params, o.step,
                               "re-run from the rewind window"))
