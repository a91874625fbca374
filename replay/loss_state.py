"""A loss that updates its own plain attributes at each call (an EMA of past losses kept in a
float, a call count a warm-up branches on): the bundle describes the loss as the event left
it, after the step's own call had updated them, so every re-run begins one update later than
the run did; the step is not made again, and the usual hint ("keep such state on the loss or
model") names what the code already does.

One more call of the step's loss, from the state a re-run begins with, tells: the attributes
it changed are named with the value they began with and the one they were left at, and the
hint says to keep them on the model, whose plain attributes the recorder reads as each step
begins.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

_PLAIN = (int, float)


def _holder(fn) -> Any:
    """The object whose attributes the loss keeps its state in: the loss module, the instance
    of a plain class called as the loss, or the one a bound method belongs to; else None."""
    if isinstance(fn, nn.Module):
        return fn
    owner = getattr(fn, "__self__", None)
    if owner is not None and not isinstance(owner, type):
        return owner
    return fn if hasattr(fn, "__dict__") and not callable(getattr(fn, "__code__", None)) \
        else None


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
            elif _plain_object(v):
                out.update({f"{name}.{a}": x for a, x in vars(v).items()
                            if isinstance(x, _PLAIN) and not isinstance(x, bool)
                            and not a.startswith("_")})
    return out


def _plain_object(v) -> bool:
    """An instance of a class of the user's holding plain values: no module, tensor, function."""
    return isinstance(getattr(v, "__dict__", None), dict) and not isinstance(
        v, (nn.Module, torch.Tensor, type)) and type(v).__module__ != "builtins" \
        and not callable(v)


def loss_self_updates(runner) -> dict[str, tuple] | None:
    """``{attribute: (began, left)}`` of the loss's plain attributes that one more call of the
    step (forward and loss, from where a re-run begins) changed; None when none did or the call
    fails. The loss is left as the call found it."""
    holder = _holder(runner.step.loss_fn)
    if holder is None or not (began := _plain(holder)):
        return None
    runner.reset()
    began = _plain(holder)
    try:
        runner.run(instrument=False, backward=False)
    except Exception:  # (a note: the report stands without it)
        return None
    finally:
        left = _plain(holder)
        _put_back(holder, began)
    moved = {k: (v, left[k]) for k, v in began.items() if k in left and not _same(v, left[k])}
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
        "and a loss's attributes are recorded as the event left them, not as the step began, "
        "so no re-run begins where the run did: keep that state as a plain attribute or buffer "
        "of a module of the model (the recorder reads those as each step begins and the "
        "replay sets them back), or pass it to the loss as an argument; then replay again")
