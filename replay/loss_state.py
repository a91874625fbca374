"""A loss that updates its own plain attributes at each call (an EMA of past losses kept in a
float, a call count a warm-up branches on). The recorder keeps them as the event's step began
(``replay.loss_started`` sets them); a bundle without them (an older recorder's), or an
attribute the loss first set in the event's own step, has them only as the event left them,
after the step's own call had updated them, so every re-run begins one update later than the
run did and the step is not made again.

One more call of the step's loss, from the state a re-run begins with, tells: the attributes
it changed (not those set as the step began) are named with the value they began with and the
one they were left at, and the hint says how to have them recorded as each step begins.
"""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from recorder.attributes import held_object, loss_holder

from .loss_started import dotted

_PLAIN = (int, float)


def _plain(holder) -> dict[str, int | float]:
    """``holder``'s public int and float attributes (not bools), and those of its submodules
    and of the plain objects it holds (``self.stats = RunningMean()``), dotted."""
    parts = holder.named_modules() if isinstance(holder, nn.Module) else [("", holder)]
    out = {}
    for prefix, obj in parts:
        for k, v in vars(obj).items():
            if k.startswith("_"):
                continue
            name = f"{prefix}.{k}" if prefix else k
            if isinstance(v, _PLAIN) and not isinstance(v, bool):
                out[name] = v
            elif held_object(v):
                out.update({f"{name}.{a}": x for a, x in vars(v).items()
                            if isinstance(x, _PLAIN) and not isinstance(x, bool)
                            and not a.startswith("_")})
    return out


def loss_self_updates(runner) -> dict[str, tuple] | None:
    """``{attribute: (began, left)}`` of the loss's plain attributes that one more call of the
    step (forward and loss, from where a re-run begins) changed; None when none did or the call
    fails. The loss is left as the call found it."""
    holder = loss_holder(runner.step.loss_fn)
    if holder is None or not (began := _plain(holder)):
        return None
    runner.reset()
    began = _plain(holder)
    try:
        with runner.loss_state.as_left():
            runner.run(instrument=False, backward=False)
    except Exception:  # (a note: the report stands without it)
        return None
    finally:
        left = _plain(holder)
        _put_back(holder, began)
    started = (runner.step.meta.get("loss") or {}).get("started")  # (set as the step began)
    set_then = {dotted(n, k) for n, attrs in (started or {}).items() for k in attrs or ()}
    moved = {k: (v, left[k]) for k, v in began.items()
             if k in left and k not in set_then and not _same(v, left[k])}
    return moved or None


def _same(a, b) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float)
                      and math.isnan(a) and math.isnan(b))


def _put_back(holder, values: dict[str, int | float]) -> None:
    for name, v in values.items():
        *path, attr = name.split(".")
        obj = holder
        for part in path:
            obj = getattr(obj, part)
        object.__setattr__(obj, attr, v)


def note_loss_updates(report: dict[str, Any], moved: dict[str, tuple]) -> None:
    """``moved`` (:func:`loss_self_updates`) into ``report``: a note, the field, the hint."""
    report["loss_updates"] = {k: list(v) for k, v in moved.items()}
    names = ", ".join(list(moved)[:3])
    vals = "; ".join(f"{k} {a!r} then {b!r}" for k, (a, b) in list(moved.items())[:3])
    report["problems"].append(
        f"the loss changes its own attribute(s) {names} at each call ({vals} in one more call "
        "of the step): the bundle holds them as the event left them, after the step's own "
        "call, so each re-run began one update later than the run did")
    report["hint"] = (
        f"the loss updates its own state at each call ({names}: a running average, a count), "
        "which this bundle holds as the event left it, not as the step began (the recorder "
        "reads a loss's plain attributes as each step begins, but not one the loss first set "
        "in the event's own step, 'if not hasattr(self, ...)' at its first call; a bundle "
        "from an older recorder has none), so no re-run begins where the "
        "run did: set them in the loss's __init__ and record again, keep that state as a "
        "plain attribute or buffer "
        "of a module of the model (the recorder reads those as each step begins and the "
        "replay sets them back), or pass it to the loss as an argument; then replay again")
