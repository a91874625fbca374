"""Pausing a recorder through training that is not the run's own.

A learning-rate range test (Lightning's ``lr_find``, a hand-written torch-lr-finder loop)
raises the learning rate until the loss diverges, to Inf or NaN on purpose, then restores the
weights and the optimizer; a batch-size search runs throwaway steps the same way. Recorded,
that intended divergence was an event that stopped the run, and its steps pushed the
recorder's step numbers past the loop's. While paused, no hook records and no step is counted:
the steps after :func:`resume` are numbered on from the last recorded one.

    with paused(rec):
        lr = range_test(model, optimizer, loader)   # diverges, restores the weights
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_PAUSED: weakref.WeakSet = weakref.WeakSet()  # the recorders this module paused


def pause(recorder: Any) -> None:
    """Stop recording: the open step is closed and checked first (a NaN made before the pause
    is still an event of the run). Nothing to do for a recorder that records nothing now
    (detached, stopped at an event, disabled by an error of its own)."""
    if recorder in _PAUSED or not recorder.health.active:
        return
    recorder.end_step()  # (may raise NonFiniteError: the run's own step)
    recorder.calls.shape_pass = False  # (else the next data forward would switch it back on)
    recorder.health.active = False
    _PAUSED.add(recorder)


def resume(recorder: Any) -> None:
    """Record again, from the next forward; unless it was detached or stopped meanwhile."""
    if recorder not in _PAUSED:
        return
    _PAUSED.discard(recorder)
    # (detach() drops the hook sites; an event or an internal error stops it for good)
    if recorder.target.sites and recorder.event is None and recorder.health.internal_errors == 0:
        recorder.health.active = True


def is_paused(recorder: Any) -> bool:
    return recorder in _PAUSED


@contextmanager
def paused(recorder: Any) -> Iterator[Any]:
    """``with paused(rec):`` runs its block unrecorded (see the module's doc)."""
    pause(recorder)
    try:
        yield recorder
    finally:
        resume(recorder)
