"""A decomposition that failed inside ``optimizer.step()`` (Shampoo's or SOAP's ``eigh``,
``cholesky`` or ``inv`` of a preconditioner gone non-finite or indefinite): the ``linalg``
event of the ``optimizer`` phase; any other error raised there gets ``recorder.update_scalar``'s
note when a setting is beyond the weights' dtype.

The optimizer's pre-hook had closed the step before the update, so the step's tape is gone
when the error reaches the loop; this runs on that exception path only. The bundle holds the
guard's copies from before the update (``guard_optimizer=True``), else the weights and state
as the failed update left them, which may be partly updated (``partly_updated``: the replay
says so). The exception goes on unchanged, with the summary as a note.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import NonFiniteError, add_note
from .events import Event
from .linalg import error_text, linalg_reason
from .update_scalar import scalar_overflow_note


@dataclass
class UpdateLinalgEvent(Event):
    """An ``optimizer`` event whose update raised; ``partly_updated``: no copy from before it
    was kept, the bundle's weights and state are as the failed update left them."""

    partly_updated: bool = False


def raised_in_step(exc: BaseException, optimizer) -> bool:
    """Whether ``exc`` was raised inside ``optimizer``'s ``step()`` (a frame of it, or of
    torch's wrapper around it, whose ``self`` is the optimizer)."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_locals.get("self") is optimizer:
            return True
        tb = tb.tb_next
    return False


def update_linalg(target, alarm, exc: BaseException, step: int, guard) -> bool:
    """Write the event and bundle of a decomposition ``optimizer.step()`` raised (``step``: the
    step the pre-hook closed; ``guard``: the optimizer guard holding its copies, or None);
    whether ``exc`` was one. Raises :class:`~recorder.NonFiniteError` in raise mode."""
    opt = target.optimizer()
    if linalg_reason(exc) is None or opt is None or not raised_in_step(exc, opt):
        return False
    copies = getattr(guard, "copies", None)
    tape = getattr(guard, "last_tape", None)
    if copies is None or tape is None or tape.step != step:
        copies = tape = None  # (not this update's: the bundle holds the state as left)
    detail = f"{error_text(exc)}, raised inside {type(opt).__name__}.step()"
    if copies is None:
        detail += ("; no copy from before the update was kept (guard_optimizer=False): the "
                   "bundle's weights and optimizer state may be partly updated")
    event = UpdateLinalgEvent(step, reason="linalg", phase="optimizer", inputs_finite=True,
                              after_update=False, detail=detail,
                              partly_updated=copies is None)
    alarm.update_linalg_event(tape, event, copies)
    return True


def update_raised(cycle, exc: Exception) -> None:
    """``cycle.check_on_exception`` of an exception raised with no step open (the pre-hook
    closed it): a decomposition that failed inside ``optimizer.step()`` gets its event and
    bundle, the summary noted on ``exc``; a setting beyond the weights' dtype, a note; anything
    else is left alone."""
    try:
        if not update_linalg(cycle.target, cycle.alarm, exc, cycle.step - 1,
                             getattr(cycle, "update_guard", None)):
            opt = cycle.target.optimizer()
            if opt is not None and raised_in_step(exc, opt) and \
                    (note := scalar_overflow_note(exc, opt, cycle.step - 1)):
                add_note(exc, note)  # (an lr beyond the weights' dtype: no event)
            return
    except NonFiniteError as e:
        add_note(exc, str(e))
        return
    except Exception as e:
        cycle.health.internal_error(e)
        return
    if cycle.alarm.event is not None:  # warn mode: noted here too
        add_note(exc, cycle.alarm.summary())
