"""The note of a re-run that an exception ended after the event's value was made: whose code
raised it and where. A module call that never returned is the model's; with every call
returned it was the loss function's (pytorch3d's ``sample_points_from_meshes`` drawing faces
by ``multinomial`` from NaN areas), which "the model's code" sent the user to look for in
the wrong place."""

from __future__ import annotations

from .run_result import Run
from .source import raised_at


def raised_note(run: Run) -> str:
    """The report's problem line for ``run.error``."""
    what = run.raised or ""
    at = raised_at(run.error) if run.error is not None else None
    if at and not what.endswith(at):
        what = f"{what} at {at}"
    whose = "the model's" if run.open else "the loss function's"
    return (f"{whose} code raised {what} in the re-run (likely as it did in training): the "
            "replay covers the step up to there")
