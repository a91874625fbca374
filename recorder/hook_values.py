"""Non-finite numbers a user's hook reads from outside its arguments, at an event.

A hook scales or shifts what it is given by a number it reads from its closure, its object
or its module's globals: a gradient reversal's ``-lambda * grad``, lambda set by a schedule
each step. A schedule that divides by 0 (``step / total`` with ``total = 0``) leaves a NaN
there, and the hook's own line (``return (-schedule["lambda"] * g,)``) does not show it. The
bundle keeps the names and kinds of those values (``schedule['lambda'] = nan``), read once
when the event is written.
"""

from __future__ import annotations

import math
from typing import Any

import torch

MAX = 3


def nonfinite_values(fn: Any) -> list[str]:
    """``NAME = nan`` (``NAME['key']``, ``self.NAME``) for each non-finite number ``fn`` reads:
    its closure's cells, the globals its code names, a callable object's attributes."""
    fn = getattr(fn, "func", fn)  # (a functools.partial)
    found: list[str] = []
    code = getattr(fn, "__code__", None)
    if code is not None:
        cells = zip(code.co_freevars, getattr(fn, "__closure__", None) or ())
        named = [(n, c.cell_contents) for n, c in cells if filled(c)]
        glob = getattr(fn, "__globals__", {})
        named += [(n, glob[n]) for n in code.co_names if n in glob]
    else:
        named = [(f"self.{k}", v) for k, v in vars(fn).items()] if hasattr(fn, "__dict__") \
            else []
    for name, value in named:
        items = [(f"{name}[{k!r}]", v) for k, v in value.items()] \
            if isinstance(value, dict) and len(value) <= 64 else [(name, value)]
        found += [f"{n} = {kind}" for n, v in items if (kind := _kind(v))]
    return found[:MAX]


def _kind(v: Any) -> str | None:
    """``nan``, ``inf`` or ``-inf`` of a Python number or a one-element tensor; else None."""
    if isinstance(v, torch.Tensor) and v.numel() == 1 and v.is_floating_point():
        v = float(v.detach().cpu())
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else "inf" if v > 0 else "-inf"
    return None


def filled(cell) -> bool:
    """Whether a closure cell holds a value (an unassigned one raises)."""
    try:
        cell.cell_contents  # noqa: B018 (an empty cell raises)
    except ValueError:
        return False
    return True
