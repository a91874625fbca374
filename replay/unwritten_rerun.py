"""A step the replay could not make again (its two re-runs disagree, or neither makes the
event), re-run once more with uninitialised memory filled with NaN.

Without ``torch.use_deterministic_algorithms(True)`` a ``torch.empty`` holds whatever its
memory held: a forward that reads entries it never wrote computes with garbage, NaN in the
run now and then and something else in each re-run, so the replay reports nondeterminism. The
extra forward, deterministic and with ``fill_uninitialized_memory`` on, under the op finder
(:mod:`replay.uninitialised`), names the allocation and the line when it reads unwritten
entries; the note says so and how to make the run reproducible. Runs with the fill already on
are left alone (their re-runs had it).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch

from .diverging_op import divergence_hint, divergence_place, divergence_sentence, first_divergence
from .findings import finish, origin_fields
from .forward import find_op_in_call
from .kept_generators import unrestored_hint
from .loss_state import loss_self_updates, note_loss_updates
from .rerun import Runner


def disagreeing(report: dict[str, Any], step, runner: Runner) -> dict[str, Any]:
    """The not-reproduced report of two re-runs that disagree, with :func:`note_unwritten`."""
    report["problems"].append("two re-runs of the step disagree: nondeterminism")
    report = finish(report, origin_fields(), "not_reproduced", reproduced=False)
    told = len(report["problems"])
    report = note_unwritten(report, step, runner)
    if len(report["problems"]) == told and (found := first_divergence(runner)) is not None:
        report["diverged"] = found  # (an unwritten read explains it already, when found)
        report["problems"].append(divergence_sentence(found))
        report["hint"] = divergence_hint(found) if not step.unrestored else \
            unrestored_hint(step.unrestored, divergence_place(found))
    in_loss = (d := report.get("diverged")) is not None and d["module"] is None \
        and d["phase"] == "forward"  # (parted in the loss: its own state, held too late?)
    if in_loss and (moved := loss_self_updates(runner)) is not None:
        note_loss_updates(report, moved)
    return report


def note_unwritten(report: dict[str, Any], step, runner: Runner) -> dict[str, Any]:
    """``report``, a not-reproduced one, with the allocation a NaN-filled re-run of the
    forward finds read unwritten as its hint and a problem; as it is when none is."""
    env = (getattr(step, "meta", None) or {}).get("env") or {}
    if env.get("deterministic_algorithms") is True and env.get("fill_uninitialized_memory") \
            is not False:
        return report  # (the re-runs filled it already: nothing unwritten was read)
    try:
        with _nan_filled():
            hit = find_op_in_call(runner, "", 0, 0).origin()
    except Exception:  # (a note: the report stands without it)
        return report
    if hit is None or not hit.unwritten:
        return report
    report["problems"].append(
        f"re-run with uninitialised memory filled with NaN, the forward reads entries that "
        f"{hit.op} at {hit.source} allocated and nothing wrote ({hit.unwritten}"
        + (f"; samples {hit.rows})" if hit.rows else ")"))
    report["hint"] = (
        f"{hit.op} at {hit.source} allocates memory without initialising it, and the step "
        f"reads entries of it never written: it computed with whatever that memory held, "
        "NaN in the run and other garbage in each re-run; allocate it with torch.zeros / "
        "new_zeros / torch.full, or write every entry before reading it. "
        "torch.use_deterministic_algorithms(True) fills such memory with NaN, so a run "
        "with it makes (and the replay reproduces) the NaN at the first such read")
    return report


@contextlib.contextmanager
def _nan_filled():
    """Deterministic mode (warn only: an op without a deterministic kernel still runs) with
    uninitialised memory filled with NaN, put back after."""
    fill = torch.utils.deterministic
    was = (torch.are_deterministic_algorithms_enabled(),
           torch.is_deterministic_algorithms_warn_only_enabled(), fill.fill_uninitialized_memory)
    torch.use_deterministic_algorithms(True, warn_only=True)
    fill.fill_uninitialized_memory = True
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])
        fill.fill_uninitialized_memory = was[2]
