"""A ``torch.amp.GradScaler`` the loop steps through that the recorder was not given
(``FlightRecorder(..., scaler=scaler)`` forgotten). Its scaled gradients overflow by design at
the start of a float16 run, and the steps whose gradients overflowed are skipped: no update
runs, so they are no event when the recorder is given the scaler. Without it, such a step is a
backward event (a false alarm) whose message and report must say what to pass. Looked for only
on the slow path (one walk of the live objects at the event), never per step."""

from __future__ import annotations

import gc

from .compat import disabled_scaler, is_grad_scaler, scaler_scale

NOT_GIVEN = ("A torch.amp.GradScaler scales this run's gradients but was not given to the "
             "recorder: the steps it skips because their scaled gradients overflowed are no "
             "events when it is; pass FlightRecorder(..., scaler=scaler).")


def unregistered_scaler_in_use() -> bool:
    """Whether a live, enabled ``GradScaler`` has scaled a loss (it holds a scale). (A scaler
    of an earlier run that only a reference cycle still holds, a caught exception's frames, is
    collected first: it is no longer in use.)"""
    gc.collect()
    return any(is_grad_scaler(o) and not disabled_scaler(o) and scaler_scale(o) is not None
               for o in gc.get_objects() if type(o).__name__.endswith("GradScaler"))
