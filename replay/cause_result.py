"""A cause found: its name (None where the classifiers could not tell) and its hint, the value
every classifier of :mod:`replay.cause` returns, and the modules it calls build too."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Cause:
    name: str | None  # "invalid", "overflow", "underflow", "precision"; None: not told
    hint: str  # what happened at the op, then what to do
