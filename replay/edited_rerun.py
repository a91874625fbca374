"""The report of an event that the edited code does not make again (``replay.edited_code``):
not nondeterminism, the user's edit since the run (an eps added after the NaN) removing the
NaN at this step, from the run's weights and batch: a what-if the origin the recorder saw goes
with."""

from __future__ import annotations

from typing import Any

from .findings import recorded_origin
from .load import Step

NOT_MADE = "not made again by the edited code"


def edited_not_reproduced(report, step: Step) -> dict[str, Any]:
    made = {"nan": "NaN", "+inf": "+Inf", "-inf": "-Inf"}.get(
        step.event.get("kind"), "non-finite value")  # (what the run made: an Inf is no NaN)
    report = recorded_origin(report, step, (
        "the edited code re-ran the step from the run's weights and batch and made no "
        f"non-finite value: the edit (see the note) removes the {made} at this step, a what-if, "
        "not nondeterminism; the origin above is what the recorder saw, with the code the run "
        "ran"))
    report["cause"] = "not_reproduced"
    report["not_rerun"] = None
    report["edited_code"] = list(step.code_edits)
    return report
