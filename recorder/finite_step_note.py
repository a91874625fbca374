"""The loop's own NaN check raised (``assert not loss.isnan()``, ``if math.isnan(loss.item()):
raise``) while every value the recorder saw in the step was finite: no bundle is written, and
the exception says why, so the user does not go looking for one. The non-finite value was made
by code no hook sees: most often a loss computed in the loop, which the recorder checks only
when given as ``loss_fn`` or through ``record_loss``."""

from __future__ import annotations

from .numeric_check import check_reason
from .tape import Tape


def finite_step_note(exc: BaseException, step: int, tape: Tape) -> str | None:
    """The note for ``exc`` raised by a NaN check (its message or raising line speaks of a
    non-finite value) in training step ``step``, recorded all finite, else None."""
    if tape.evaluation or check_reason(exc) is None:
        return None
    loss_seen = bool(tape.loss)
    seen = "the model's calls and the loss" if loss_seen else "the model's calls"
    where = ("code outside them (a term added to the loss after loss_fn, a metric)"
             if loss_seen else
             "code outside them, most often the loss computed in the loop, which the recorder "
             "checks only when given: pass loss_fn= (the loss module or function) to "
             "FlightRecorder, or call rec.record_loss(loss) before this check, and the step's "
             "bundle is written here for nanreplay")
    return (f"nanreplay: every value the recorder saw in step {step} ({seen}) was finite, so "
            f"no bundle was written: the non-finite value was made by {where}")
