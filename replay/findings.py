"""The report ``analyze`` returns, as a dict: its keys, the origin's fields, and finishing it
with a finding (origin, cause, whether the event came back, the hint, the source line).

:func:`base_report` holds everything known before a re-run (the event, the history and its
precursors); each localisation fills the origin and the cause through :func:`finish`.
"""

from __future__ import annotations

from functools import cache, partial
from typing import Any

from .cause_text import HINTS
from .forward_steps import forward_steps_note
from .load import Step
from .precursors import find_precursors, history, module_dtypes
from .rebuild import NO_FACTORY, NO_FACTORY_NEEDED
from .source import statement
from .unmeasured_weights import built_norm, unmeasured

FORMAT = "nanreplay-report/1"
# the note of an optimizer event whose bundle holds the weights after the update (a rewind
# window re-runs the update and takes the note back: replay.window_report)
#: ``not_rerun`` of an update whose bundle holds the weights after it (a window re-runs it)
AFTER_UPDATE = "the bundle holds the weights after the update"
UPDATE_NOT_RERUN = ("the bundle holds the weights after the update that made them non-finite, "
                    "so the update cannot be re-run; record with FlightRecorder(..., "
                    "guard_optimizer=True) to replay it")
#: the same two of an update that left only the optimizer's state non-finite (replay.state_overflow)
STATE_AFTER_UPDATE = "the bundle holds the state after the update"
STATE_NOT_RERUN = ("the bundle holds the optimizer state after the update that made it "
                   "non-finite (the weights it left are finite), so the update is not re-run")


def origin_fields(**kw) -> dict[str, Any]:
    base = {"phase": None, "module": None, "call": None, "op": None, "param": None,
            "params": [], "tensor": None, "samples": [], "source": None, "chain": [],
            "micro_batch": None, "inputs_finite": None, "made": None, "detail": None}
    base.update(kw)
    return base


def base_report(step: Step) -> dict[str, Any]:
    meta = step.meta
    ev = step.event
    env = meta.get("env", {})
    hist = history(meta, step.tensors)
    dtypes = module_dtypes(meta)
    # (weights a loop's own update wrote, never measured: the factory's model is the baseline)
    built = cache(partial(built_norm, step)) if unmeasured(meta, hist) else None
    return {
        "format": FORMAT,
        "bundle": {"path": str(step.path), "rank": env.get("rank", 0), "torch": env.get("torch"),
                   "stripped": step.stripped, **_ranks(step)},
        "event": {"step": ev.get("step"), "phase": ev.get("phase"), "module": ev.get("module"),
                  "call": ev.get("call"), "micro_batch": ev.get("micro_batch"),
                  "micro_batches": len(step.micro_batches),  # (the step's: 1 without a window)
                  "kind": ev.get("kind"), "params": ev.get("params", []),
                  "tensor": ev.get("tensor"), "samples": ev.get("samples", []),
                  "detail": ev.get("detail"), "evaluation": bool(ev.get("evaluation")),
                  "compiled": bool(ev.get("compiled")) or (  # (a compiled loss function)
                      ev.get("module") == "<loss>" and bool((meta.get("loss") or {}).get(
                          "compiled"))),
                  # (gradients the compiled regions' backward graphs made)
                  "through_compiled": ev.get("phase") == "backward"
                  and bool(meta.get("compiled_regions")),
                  # (an update whose step() closed no recorded step: replay.unrecorded_update)
                  **({"no_step_closed": True} if ev.get("no_step_closed") else {}),
                  # (the loop's last forwards, which no backward followed: recorder.events)
                  **({"no_backward": True} if ev.get("no_backward") else {})},
        "reproduced": False,
        "not_rerun": None,  # why the step, or its loss, was not re-run ("weights stripped")
        "diverged": None,  # where two re-runs that disagree part ways (replay.diverging_op)
        "origin": origin_fields(),
        "cause": None,
        "hint": None,
        "precursors": find_precursors(hist, dtypes=dtypes, built=built),
        "bisection": None,
        "fidelity": None,
        "problems": list(step.problems) + forward_steps_note(meta, hist),
        "window": None,  # the rewind window re-run (replay.window_report)
        "what_if": [],  # the --try what-ifs (replay.whatif)
        "history": hist,
    }


def _ranks(step: Step) -> dict[str, Any]:
    """Under torch.distributed: the bundle given (``given``, its rank) when the first rank's
    bundle beside it is replayed instead, the world size and the ranks that saw the event
    first; ``{}`` for a single process."""
    ranks = step.event.get("ranks")
    if not isinstance(ranks, dict) or not ranks.get("world_size"):
        return {}
    out = {"world_size": ranks.get("world_size"), "first_ranks": ranks.get("first")}
    if step.given is not None:
        out.update(given=str(step.given), given_rank=step.given_rank)
    return out


def finish(report, origin, cause, *, reproduced: bool, hint: str | None = None
           ) -> dict[str, Any]:
    if report["event"].get("through_compiled") and not reproduced:
        report["problems"].append(
            "the gradients were made by the backward graphs of torch.compile'd modules ("
            "the bundle's compiled_regions) and the replay runs them eagerly: values only the "
            "compiled kernels make (fused arithmetic, a reordered reduction) do not come back")
    elif report["event"].get("compiled") and not reproduced:
        report["problems"].append(
            "the event was recorded inside a torch.compile'd module and the replay runs it "
            "eagerly: values only the compiled kernels make (fused arithmetic, inductor's own "
            "dropout random numbers) do not come back; to make dropout replayable, train with "
            "torch._inductor.config.fallback_random = True")
    if cause == "input" and reproduced and origin.get("phase") == "input":
        # read from the bundle's batch: a model would not change it, so offer none
        report["problems"] = [NO_FACTORY_NEEDED if p.startswith(NO_FACTORY) else p
                              for p in report["problems"]]
    if origin.get("phase") and origin.get("made") is None:
        # what the blamed op made, else what was recorded: the text report's origin line,
        # the HTML verdict and --json then say the same
        chain = [c for c in origin.get("chain") or () if isinstance(c, dict) and c.get("made")]
        blamed = [c for c in chain if c.get("op") == origin.get("op")] or chain
        origin["made"] = blamed[0]["made"] if blamed else report["event"].get("kind")
    report["origin"] = origin
    report["cause"] = cause
    report["reproduced"] = reproduced
    report["hint"] = hint or HINTS.get(cause)
    src = origin.get("source")
    if src:
        path, _, line = src.rpartition(":")
        text = statement(path, int(line)) if line.isdigit() else ""
        report["source_lines"] = {src: text} if text else {}
    return report


def recorded_origin(report, step: Step, hint: str) -> dict[str, Any]:
    """The origin the recorder saw, not reproduced and with no cause: nothing re-run is
    evidence (the model could not be rebuilt, or was rebuilt differently)."""
    ev = step.event
    report = finish(report, origin_fields(
        phase=ev.get("phase"), module=ev.get("module"), call=ev.get("call"),
        micro_batch=ev.get("micro_batch"), tensor=ev.get("tensor"),
        samples=ev.get("samples", []), params=ev.get("params", []),
        param=(ev.get("params") or [None])[0], made=ev.get("kind"),
        inputs_finite=ev.get("inputs_finite")), None, reproduced=False)
    report["hint"] = hint
    return report
