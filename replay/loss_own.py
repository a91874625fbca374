"""Which of the loss's attributes recorded as the step began its own call changes.

The recorder reads the loss's plain attributes as each step begins (its first forward), but
the loop may set one between that forward and the loss call (DINO's ``crit.teacher_temp =
0.0`` after the forwards): the call computed with the value the event left, not the step-start
one. So, where the two differ, one re-run of the step (forward and loss) from the step-start
values tells: an attribute the call changes is the loss's own state (a running mean, a call
count) and is set as the step began (``replay.loss_started``); one it leaves alone was the
loop's setting and keeps the event's value, and is dropped from the bundle's ``started`` and
``attrs_at_attach`` as read here, so no later re-run sets it either."""

from __future__ import annotations

from typing import Any

from recorder.attributes import loss_objects

from .load import Step
from .loss_started import set_loss_started
from .rerun import Runner


def settle_loss_started(step: Step) -> None:
    """Set the loss's step-start attributes on the rebuilt loss, but those its own call does
    not change (see the module docstring)."""
    loss_meta = step.meta.get("loss")
    started = loss_meta.get("started") if isinstance(loss_meta, dict) else None
    if step.model is None or step.loss_fn is None or not isinstance(started, dict):
        return
    objects = dict(loss_objects(step.loss_fn))
    event = _values(objects, started)
    set_loss_started(loss_meta, step.loss_fn)
    began = _values(objects, started)
    differ = [key for key, v in began.items() if key in event and not _same(v, event[key])]
    if not differ:
        return
    runner = Runner(step)
    try:
        with runner.loss_state.as_left():
            runner.run(instrument=False, backward=False)
        left = _values(objects, started)
    except Exception:  # (the step's code raising: each keeps its step-start value)
        return
    finally:
        runner.reset()
    for name, k in differ:
        if _same(left.get((name, k)), began[name, k]):  # the loop's setting: the event's
            setattr(objects[name], k, event[name, k])
            for entry in (started, loss_meta.get("attrs_at_attach") or {}):
                (entry.get(name) or {}).pop(k, None)


def _values(objects: dict[str, Any], started: dict) -> dict[tuple[str, str], Any]:
    return {(n, k): getattr(objects[n], k) for n, attrs in started.items()
            if n in objects and isinstance(attrs, dict) for k in attrs
            if hasattr(objects[n], k)}


def _same(a, b) -> bool:
    return type(a) is type(b) and (a == b or a != a and b != b)
