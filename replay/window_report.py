"""The report's ``window`` part: the bundle's rewind window re-run (``replay.window``), whether it
reaches the recorded event at the recorded step, the first step where anything went
non-finite, and where the precursors began (its words: :mod:`replay.rewind_text`). An optimizer event caught after its update becomes
replayable: the update is re-run from the window and the op that made the value is named.
"""

from __future__ import annotations

import math
from typing import Any

from recorder.finite import finite

from .between_writes import written_note
from .cause_text import DO
from .decay_divergence import decay_growth, decay_text
from .departure import departure
from .findings import (
    AFTER_UPDATE,
    STATE_AFTER_UPDATE,
    STATE_NOT_RERUN,
    UPDATE_NOT_RERUN,
    finish,
    origin_fields,
)
from .load import Step
from .optimizer_origin import optimizer_hint
from .rewind_text import where
from .update_bound import bound_advice
from .update_domain import owner_type, updated_rows
from .weight_readers import bad_row_fields, rows_text
from .window import matches_event, precursors_began, run_window, window_of
from .zero_rate import zero_rate_why


def add_window(step: Step, report: dict[str, Any]) -> bool:
    """Fill ``report["window"]`` (None without a window) and, for an optimizer event, the
    origin from the re-run update. Returns whether the hint now says the weights grew."""
    report["window"] = None
    win = window_of(step)
    if win is None or step.model is None:
        return False
    if (why := _not_rerunnable(step, report)) is not None:
        report["problems"].append(f"the rewind window was not re-run: {why}")
        return False
    res = run_window(step, win)
    o = res.first
    ev = step.event
    # a weights event whose weights the copy holds non-finite: they came in before the window
    # (no step of it can make them again)
    ok = matches_event(step, o) or bool(ev.get("phase") == "weights" and ev.get("params")
                                        and _bad_in_copy(step, win, ev["params"]))
    first, last = win.records[0]["step"], win.records[-1]["step"]
    report["window"] = {
        "copy_step": win.copy_step, "steps": [first, last], "reproduced": ok,
        "event_step": o.step if o else None,
        "first_non_finite": o.as_json() if o else None,
        "precursors_began": precursors_began(res.per_step),
        "per_step": res.per_step, "loop_clip": win.loop_clip, "loss_factors": win.loss_factors,
        "loop_unscale": win.loop_unscale, "loop_zeroes": win.loop_zeroes,
    }
    report["problems"] += res.problems
    if (departed := departure(step, res.per_step, win.loop_clip,
                                   res.weight_norms)) is not None:
        report["window"]["departed"], note = departed
        report["problems"].append(note)
    grew = _hint_growth(step, report)
    if o is None and not ok:
        report["problems"].append(
            f"re-running the window from the copy at step {win.copy_step} reached step {last} "
            "with every value finite: the event does not come back from the window"
            + ("; the loop replaced parameters since attach (replaced_params), which the "
               "window's steps do not redo" if step.meta.get("replaced_params") else "")
            + (f"; {note}" if (note := written_note(step)) else ""))
    elif not ok:
        report["problems"].append(
            f"re-running the window, the first non-finite value is at step {o.step} "
            f"({where(o.as_json())}), not the recorded {ev.get('phase')} event at step "
            f"{ev.get('step')}")
    # (an update that raised, a failed decomposition, names no weights: its origin is the
    # re-run update's, replay.update_linalg)
    if (ev.get("phase") == "optimizer" and o is not None and o.phase == "update" and o.params
            and o.state is None):
        if (bad := _bad_in_copy(step, win, o.params)):
            _weights_origin(step, report, o, ok, bad, win.copy_step)
        else:
            _optimizer_origin(step, report, o, ok)
    elif o is not None and o.state is not None and ok:  # (a state event keeps its cause)
        _update_rerun(report)
        report["reproduced"] = True
    return grew


def _not_rerunnable(step: Step, report: dict[str, Any]) -> str | None:
    """Why re-running the window's steps from its copy would not be the steps that ran (their
    "every value finite" would say nothing), or None."""
    if (report.get("fidelity") or {}).get("within_step"):
        return ("a forward of the event step ran with weights the bundle does not hold "
                "(passed in through functional_call, as a MAML inner loop does), and the "
                "window's steps would run with the model's own")
    if not step.micro_batches and step.event.get("after_update"):
        # (the window's log keeps the event step's batch when that step closed before its
        # update was checked: Adam's first update of float16 weights, caught after it; or one
        # that left only its state non-finite, whose state the re-run checks as training did)
        if _window_holds_event_step(step):
            return None
        return ("the event was found after its step's update, and the bundle holds no batch of "
                "that step to re-run it with (guard_optimizer=True keeps it)")
    if not step.micro_batches:
        return ("the event step ran no forward of the recorded model (the loop wrote its "
                "gradients, as Reptile's from a copy it trained), which a re-run cannot make")
    if regrown := _regrown_in_window(step):
        return (f"the loop replaced {regrown} with a parameter of another shape after the "
                "window's copy was taken (densification or pruning), which the window's steps "
                "cannot redo: the event step's own re-run is the evidence")
    return None


def _window_holds_event_step(step: Step) -> bool:
    """The rewind window's log holds the event step with its micro-batches: re-running the
    window from its copy re-runs that step's update too."""
    win = window_of(step)
    at = step.event.get("step")
    return win is not None and any(r.get("step") == at and r.get("micro_batches")
                                   for r in win.records)


def _regrown_in_window(step: Step) -> str | None:
    """The first parameter the loop replaced (``replaced_params``) whose shape in the
    window's copy is not the event step's, or None."""
    for n in step.meta.get("replaced_params") or ():
        copy, now = step.tensors.get(f"rewind/weights/{n}"), step.tensors.get(f"weights/{n}")
        if copy is not None and now is not None and copy.shape != now.shape:
            return n
    return None


def _bad_in_copy(step: Step, win, params: list[str]) -> list[str]:
    """Of the parameters an update re-run from the window left non-finite, those already
    non-finite in the window's copy: the update carried them on, it did not make them."""
    copies = ((n, step.tensors.get(f"{win.prefix}weights/{n}")) for n in params)
    return [n for n, t in copies if t is not None and not finite(t)]


def _weights_origin(step: Step, report: dict[str, Any], o, ok: bool, bad: list[str],
                    copy_step: int) -> None:
    """An optimizer event whose weights the window's copy shows non-finite before any update
    it re-runs (an embedding row no forward had read yet, so no check saw it, which the
    update then wrote back): a ``weights`` cause."""
    _update_rerun(report)
    rows = bad_row_fields(step, bad[0], prefix="rewind/")
    origin = origin_fields(phase="weights", params=bad, param=bad[0], made=o.kind, **rows)
    where = rows_text(bad[0], rows)
    finish(report, origin, "weights", reproduced=ok, hint=(
        f"{bad[0]} was already non-finite in the rewind window's copy, taken as step "
        f"{copy_step} began: the update at step {o.step} carried it on, it did not make it. "
        "No forward had read those values (the recorder sees a weight through what reads "
        "it, and an update's result), so they were written outside optimizer.step() before "
        "then: at initialisation, resizing or loading" + (f"; {where}" if where else "")))


def _update_rerun(report: dict[str, Any]) -> None:
    """The window re-ran the update the bundle holds the weights (or the state) after: neither
    the note nor ``not_rerun`` (the text's first line, the JSON) may still say it was not."""
    report["problems"] = [p for p in report["problems"]
                          if p not in (UPDATE_NOT_RERUN, STATE_NOT_RERUN)]
    if report.get("not_rerun") in (AFTER_UPDATE, STATE_AFTER_UPDATE):
        report["not_rerun"] = None


def _hint_growth(step: Step, report: dict[str, Any], factor: float = 10.0) -> bool:
    """An overflow of weights the window shows blown up from an earlier step (by a bad batch,
    a learning-rate jump, a steady divergence) is that step's doing: the hint, which says what
    float64 would hold at the op, says where the growth began and what bounds it (the tries
    of ``lr`` and ``clip`` test it). Values that grew with the weights steady (inputs whose
    scale drifts) keep the hint as it is. Returns whether it said so (the run was diverging,
    which the hint then says once: see ``analyze._diverging``)."""
    w, ev = report["window"], report["event"]
    began = w.get("precursors_began")
    if report.get("cause") != "overflow" or not w["reproduced"] or not began \
            or began["step"] >= ev.get("step", began["step"]):
        return False
    norms = [(s["step"], s["param_norm"]) for s in w["per_step"]
             if isinstance(s.get("param_norm"), float) and math.isfinite(s["param_norm"])]
    before = [v for k, v in norms if k < began["step"]] or [v for _, v in norms[:1]]
    after = [(k, v) for k, v in norms if k >= began["step"]]
    if not before or not after or not before[-1] > 0:
        return False
    last, top = after[-1]
    if top < factor * before[-1]:
        return False
    updates = (f"the update of step {last}" if last == began["step"]
               else f"the updates of steps {began['step']}-{last}")
    decay = decay_growth(step, report)  # (the optimizer's own weight decay: it grows them)
    report["hint"] = (f"{report['hint']}. But the weight norm grew {top / before[-1]:.3g}x "
                      f"over {updates}, from where the "
                      f"rewind window shows the trouble began ({began['detail']}): the run "
                      "was diverging, and a wider type only postpones the overflow; "
                      + (decay_text(step, decay, windowed=True) if decay else
                         "fix what happened there (a bad batch, a learning-rate jump) or "
                         + (bound_advice(step, True) or DO["diverging_window"])))
    return True


def _optimizer_origin(step: Step, report: dict[str, Any], o, ok: bool) -> None:
    _update_rerun(report)
    origin = {**report["origin"], "phase": "optimizer", "params": o.params,
              "param": o.params[0], "op": o.op, "source": o.source, "chain": o.chain,
              "made": o.kind, "step": o.step, "domain": o.domain,
              **({"zero_rate": o.zero_rate} if zero_rate_why(o.domain, o.zero_rate) else {})}
    # (the rows it broke, from the weights and gradients the re-run's update left, as the
    # event step's own re-run says them)
    p = dict(step.model.named_parameters()).get(o.params[0])
    rows, where = ({}, "") if p is None else updated_rows(
        o.params[0], p, owner_type(step.meta, o.params[0]), step.model)
    origin.update(rows)
    finish(report, origin, "optimizer", reproduced=ok,
           hint=optimizer_hint(step, o.op, o.kind, o.params, o.step,
                               "re-run from the rewind window", domain=o.domain,
                               stale_why=o.stale_why, rate=o.zero_rate) + where)
