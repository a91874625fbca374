"""A ``torch.amp.GradScaler`` the loop steps through that the recorder was not given
(``FlightRecorder(..., scaler=scaler)`` forgotten). Its scaled gradients overflow by design at
the start of a float16 run, and the steps whose gradients overflowed are skipped: no update
runs, so they are no event when the recorder is given the scaler. Without it, such a step is a
backward event (a false alarm) whose message and report must say what to pass. Looked for only
on the slow path (one walk of the live objects at the event), never per step."""

from __future__ import annotations

import gc
import sys
import traceback

from .compat import disabled_scaler, is_grad_scaler, scaler_scale, scaler_tensors

NOT_GIVEN = ("A torch.amp.GradScaler scales this run's gradients but was not given to the "
             "recorder: the steps it skips because their scaled gradients overflowed are no "
             "events when it is; pass FlightRecorder(..., scaler=scaler).")
# a step the scaler skipped calls no optimizer.step(), which is where the recorder closes a
# step: without the scaler, the loop's next batches are read as micro-batches of that step
OPEN_STEP = (" Its last update was skipped (or none ran yet), and a skipped update calls no "
             "optimizer.step(), where the recorder closes a step: it took the loop's next "
             "batches for micro-batches of one step, so micro-batch {mb} of step {step} is "
             "the loop's batch {mb} (counted from 0) since its last update that ran, unless "
             "the loop accumulates gradients.")


def not_given(meta: dict) -> str:
    """What a bundle's ``meta["scaler_not_given"]`` says: :data:`NOT_GIVEN`, and where the
    event is a later micro-batch the skips made (a dict of its step and micro-batch), how."""
    said = meta.get("scaler_not_given")
    return NOT_GIVEN + (OPEN_STEP.format(**said) if isinstance(said, dict) else "")


def scaler_left_open(phase: str, step: int, micro_batch: int | None) -> bool | dict | None:
    """What an event says of a GradScaler it was not given (``meta["scaler_not_given"]``):
    True at a backward event, where the scaler's overflow may be the event; where a later
    micro-batch's event may be a skipped step the scaler left open, that step and micro-batch
    (checked at the event only); else None."""
    if phase != "backward" and not micro_batch:
        return None
    scalers = unregistered_scalers()
    if phase == "backward":
        return bool(scalers) or None
    # (a loop accumulating micro-batches between updates that ran: its tracker counts them)
    return {"step": step, "mb": micro_batch} if any(map(_last_skipped, scalers)) else None


def unregistered_scalers() -> list:
    """The live, enabled ``GradScaler``s that have scaled a loss (they hold a scale). (A scaler
    of an earlier run that only a reference cycle still holds, a caught exception's frames, is
    no longer in use: where one is found, a collection runs and the walk is taken again. A
    collection costs more than the walk in a large process, and most runs have no scaler.)"""
    if not _scalers():
        return []
    gc.collect()
    return _scalers()


def _scalers() -> list:
    # Each instance of a Python class refers to its class, so the collector's C walk of the
    # referrers finds them: in a large process (a test run, a notebook with Transformers
    # imported: a million objects) a third of the time of testing each live object in Python.
    if _NONE_SINCE and _NONE_SINCE[0] == _state(_NONE_SINCE[1]):
        return []
    kinds = tuple(_scaler_classes())
    live = [o for o in gc.get_referrers(*kinds) if type(o) in kinds and is_grad_scaler(o)] \
        if kinds else []
    _NONE_SINCE.clear()
    if not live:
        _NONE_SINCE.extend((_state(kinds), kinds))
    return [o for o in live if not disabled_scaler(o) and scaler_scale(o) is not None]


# After a walk that found no scaler at all: the state then (see _state) and the classes walked.
# That walk costs 0.2 s at each backward event in a process of ~800k objects (7 % of the test
# suite's time); while the state is the same, no scaler was made since.
_NONE_SINCE: list = []


def _state(kinds: tuple[type, ...]) -> tuple[int, tuple[int, ...]]:
    """How many modules are imported, and each scaler class's reference count: an instance
    holds a reference to its class, a new subclass to its bases (a new class of another
    name would come with a new module, or be defined in a running one: not seen until the
    next import)."""
    return len(sys.modules), tuple(sys.getrefcount(k) for k in kinds)


def _scaler_classes() -> set[type]:
    """Every class named ``*GradScaler`` (torch's, FSDP's ``ShardedGradScaler``, a library's
    own scaler class with GradScaler's state)."""
    found, seen, todo = set(), set(), [object]
    while todo:
        try:
            subclasses = type.__subclasses__(todo.pop())
        except TypeError:  # a metaclass's own __subclasses__ needs its instance
            continue
        for k in subclasses:
            if k not in seen:
                seen.add(k)
                todo.append(k)
                if k.__name__.endswith("GradScaler"):
                    found.add(k)
    return found


def unregistered_scaler_in_use() -> bool:
    """Whether such a scaler is live (see :func:`unregistered_scalers`)."""
    return bool(unregistered_scalers())


def _last_skipped(scaler) -> bool:
    """Whether ``scaler``'s last ``update()`` followed a skipped step (or none ran yet): its
    growth tracker is 0, as a skip resets it (a step that ran adds 1)."""
    tracker = scaler_tensors(scaler).get("growth_tracker")
    return tracker is not None and int(tracker) == 0


def raised_by_scaler(exc: BaseException) -> bool:
    """Whether a GradScaler's own code raised ``exc`` (``unscale_`` refusing float16
    gradients, ``step`` on an optimizer it cannot handle): the step's gradients were still
    scaled, and their overflow is the scaler's to skip, not an event."""
    return any(is_grad_scaler(f.f_locals.get("self"))
               for f, _ in traceback.walk_tb(exc.__traceback__))
