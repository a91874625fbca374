"""The note of a re-run that an exception ended after the event's value was made: whose code
raised it and where. A module call that never returned is the model's; with every call
returned it was the loss function's (pytorch3d's ``sample_points_from_meshes`` drawing faces
by ``multinomial`` from NaN areas), which "the model's code" sent the user to look for in
the wrong place. One a derivative raised in the backward (eigvals' at repeated eigenvalues)
is neither's."""

from __future__ import annotations

from .run_result import Run
from .source import raised_at

# Set on an exception a derivative raised during the re-run's backward (the step's graph).
IN_BACKWARD = "_nanreplay_in_backward"


def raised_note(run: Run) -> str:
    """The report's problem line for ``run.error``."""
    what = run.raised or ""
    at = raised_at(run.error) if run.error is not None else None
    if at and not what.endswith(at):
        what = f"{what} at {at}"
    whose = ("a derivative in the step's backward (not code of yours)"
             if getattr(run.error, IN_BACKWARD, False)
             else "the model's code" if run.open else "the loss function's code")
    return (f"{whose} raised {what} in the re-run (likely as it did in training): the "
            "replay covers the step up to there")
