"""An overflow (or an underflow) that a diverging run made: the loss, gradient norm, rate or
weights had jumped before it, or a buffer the model carries across steps had grown far past
its built value; the hint says a wider type only postpones it, and what to do instead."""

from __future__ import annotations

from .batch_overflow import said_of_data
from .foreign_update import foreign_advice
from .grown_state import grown_state_advice
from .load import Step
from .precursors import transient
from .weight_scale import diverging_advice
from .window import window_of

# precursors that say the training itself was growing, not one op's range (a learning rate
# that jumped in an earlier step drove the weights there)
_GROWTH = {"loss_jump": "loss", "grad_norm_jump": "gradient norm", "weight_jump": "weights",
           "lr_jump": "learning rate"}


def growth_jump(report) -> dict | None:
    """The first precursor saying the training itself grew before the event step (a loss,
    gradient norm, rate or weight jump that did not settle back), or None."""
    at = report["event"].get("step")
    if at is None:
        return None
    # (a weight jump at the event step is the update before it: the weights the step began with)
    return next((p for p in report.get("precursors") or [] if p.get("kind") in _GROWTH
                 and p.get("step") is not None and (p["step"] < at or p["step"] == at
                                                    and p["kind"] == "weight_jump")
                 and not transient(report.get("history") or {}, p)), None)


def diverging_hint(report, step: Step) -> None:
    """An overflow (or an underflow: a sigmoid driven to 0) after the loss, gradient norm, rate
    or weights jumped: the run was diverging (a rate too high for unscaled features), and a
    wider type only postpones it; the hint says so (and, without a rewind window, how to record
    the steps that grew). Without such a jump, an overflow after a buffer the model carries
    across steps grew far past its built value (``replay.grown_state``) names that buffer.
    Not of an op on the batch's data alone: nothing learned reaches it."""
    at, cause = report["event"].get("step"), report.get("cause")
    if cause not in ("overflow", "underflow") or at is None or said_of_data(report):
        return
    jump, foreign = growth_jump(report), foreign_advice(step, report)
    if jump is None and foreign:  # (the event's weights, updated by an unrecorded optimizer)
        report["hint"] = f"{report['hint']}. But {foreign}"
        return
    if jump is None:
        # (no jump in the window's loss or weights, yet a buffer the model carries across
        # steps had grown far past its built value: FORCE's P under a forgetting factor
        # grows whether or not the loss showed it by the event, as the CPU's rounding has it)
        if cause == "overflow" and (grown := grown_state_advice(step)):
            report["hint"] = f"{report['hint']}. But {grown}"
        return
    when = f"in the update before step {at}" if jump["step"] == at else \
        f"at step {jump['step']}"
    then = ("a wider type only postpones the overflow" if cause == "overflow" else
            "the values this op took grew extreme with it, and log space or a wider type "
            "only moves the failure on")
    report["hint"] = (f"{report['hint']}. But the {_GROWTH[jump['kind']]} had jumped "
                      f"{when} (see precursors): the run was diverging, and {then}; "
                      + (foreign or diverging_advice(step, window_of(step) is not None)))
