"""An analysis stage that raised: the report keeps what is known instead of 'replay failed'.

The replay's watched re-runs (the op finder's dispatch mode, hooks on autograd's nodes, anomaly
mode, the float64 re-run, the bisection) run torch under modes the training step did not:
torch's own code may fail there (as ``torch.cond``'s backward did, given the user's branch
under a dispatch mode: ``TypeError: object of type 'bool' has no len()``) where the plain step
ran. Such a failure
costs what that stage would have added, not the report: the recorder's step, phase, module and
samples stay, ``reproduced`` is what the plain re-run showed, the cause is left unknown with
the reason, and a note names the stage, the error and what to do. The model's own code raising
(as it did in training) is the user's error and keeps its own wording (see
:func:`replay.source.raised_by_model`).
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

from recorder.errors import BundleError

from .errors import ReplayError, one_line
from .findings import recorded_origin
from .load import Step
from .source import raised_by_model

__all__ = ["Known", "kept_going", "show_tracebacks", "stage_of", "survived"]

_DIR = os.path.dirname(os.path.abspath(__file__))
# the replay modules a failure is named by (the innermost one of them in the traceback)
_STAGES = {
    "backward": ("the backward op finder", "hooks on autograd's nodes, then anomaly mode"),
    "ops": ("the op finder", "a dispatch mode watching every op"),
    "dispatch": ("the op finder", "a dispatch mode watching every op"),
    "bisection": ("the bisection", "re-runs stopped at a module call"),
    "float64": ("the float64 re-run", ""), "float64_step": ("the float64 re-run", ""),
    "window": ("the rewind window", ""), "window_report": ("the rewind window", ""),
    "whatif": ("the what-ifs (--try)", ""),
    "diverging_op": ("the re-runs fingerprinting every op", ""),
    "rerun": ("the plain re-run of the step", ""),
}
# shared by every re-run or passing each op on: the stage is the module that called them
_PLUMBING = {"run_result", "compat", "source", "errors", "instrument", "load", "grad_hooks",
             "lost_eps", "below_one", "failed_stage"}


_DEBUG = [False]


def show_tracebacks(on: bool) -> None:
    """``--debug``: a failed stage's traceback is printed to stderr as well as noted."""
    _DEBUG[0] = on


def _failed(report: dict[str, Any], e: BaseException, fn: Callable | None = None) -> str:
    """The stage ``e`` failed in, noted in ``report`` (and its traceback under --debug)."""
    if _DEBUG[0]:
        traceback.print_exception(e, file=sys.stderr)
    stage = stage_of(e, fn)
    report["problems"].append(_note(stage, e))
    report.setdefault("failed_stage", {"stage": stage,
                                       "error": f"{type(e).__name__}: {one_line(e, 200)}"})
    return stage


class Known:
    """What the analysis learnt before a stage failed: the plain re-run of the step."""

    def __init__(self) -> None:
        self.run = None


def stage_of(e: BaseException, fn: Callable | None = None) -> str:
    """The stage that raised ``e``, in words, with the replay's function for a bug report
    (``fn``, the function called, where the traceback holds none of the replay's)."""
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if os.path.dirname(os.path.abspath(f.filename)) == _DIR]
    named = [f for f in frames if _stem(f.filename) not in _PLUMBING]
    # (a watched re-run's frames hold rerun's too: the plain re-run only when no other stage)
    staged = [f for f in named if _stem(f.filename) in _STAGES]
    frame = next((f for f in reversed(staged) if _stem(f.filename) != "rerun"),
                 (staged or named or frames or [None])[-1])
    if frame is None or not named and fn is not None:
        name = f"{getattr(fn, '__module__', None) or ''}.{getattr(fn, '__qualname__', '')}"
        return f"the analysis {name.strip('.')}" if fn is not None else "the analysis"
    stem = _stem(frame.filename)
    where = f"replay.{stem}.{frame.name}"
    if stem not in _STAGES:
        return f"the analysis {where}"
    name, how = _STAGES[stem]
    return f"{name} ({where}{': ' + how if how else ''})"


def _stem(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0]


def _ours(e: BaseException) -> bool:
    """Whether ``e`` is a failure of the analysis (torch's code under the replay's modes, or
    a bug of ours), not a clear error of the replay's or the model's own code raising."""
    return not isinstance(e, (ReplayError, BundleError)) and not raised_by_model(e)


def _note(stage: str, e: BaseException) -> str:
    return (f"{stage} raised {type(e).__name__} ({one_line(e, 200)}), inside torch or the "
            "replay, where the training step did not: the report holds what was known before "
            "it; re-run with --debug for the traceback and attach it with the bundle to an "
            "issue (nanreplay --strip batch -o share.nan leaves the data out)")


def survived(report: dict[str, Any], fn: Callable[..., Any], *args) -> Any:
    """``fn(*args)``, a stage adding to a report that has its origin: when it fails (see
    :func:`_ours`), a note says so and None stands for what it would have returned."""
    try:
        return fn(*args)
    except Exception as e:
        if not _ours(e):
            raise
        _failed(report, e, fn)
        return None


def kept_going(report: dict[str, Any], step: Step, known: Known,
               analysis: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``analysis()``, the re-run's report; when a stage of it fails, the recorder's origin
    with ``reproduced`` from the plain re-run (``known.run``) and the cause left unknown."""
    try:
        return analysis()
    except Exception as e:
        if not _ours(e):
            raise
        stage = _failed(report, e)
        phase = step.event.get("phase")
        again = known.run is not None and _made_again(known.run, phase)
        seen = ("the plain re-run made the event again" if again else
                "the plain re-run did not make the event again" if known.run is not None
                else "the plain re-run did not finish")
        report = recorded_origin(report, step, (
            f"the origin above is what the recorder saw, and {seen}; {stage} failed before "
            "it named the op and the cause (see the note)"))
        report["reproduced"] = again
        return report


def _made_again(run, phase: str | None) -> bool:
    """Whether the plain re-run ``run`` made a non-finite value where the event was."""
    if phase == "forward":
        return run.forward_origin() is not None
    if phase == "loss":
        return bool(run.loss_finite) and not all(run.loss_finite)
    if phase == "backward":
        return bool(run.bad_grads)
    return False
