"""Modules' plain attributes (int, float, bool): the loop may set them during training (a
temperature annealed to 0, a scheduled dropout ``p``, a flag), and a factory builds them as
they started. The bundle keeps those the run changed after attach, so the replay can set them
again; one the factory builds otherwise from the start is the factory's difference, which the
replay's fidelity check reports (and ``--factory-kwargs`` fixes), so it is not overridden."""

from __future__ import annotations

import math
from typing import Any

from torch import nn

PLAIN = (int, float, bool)


def plain_attributes(m: nn.Module) -> dict[str, int | float | bool]:
    """The module's own public int, float and bool attributes now (not ``training``: the
    modes are recorded and set on their own)."""
    return {k: v for k, v in vars(m).items() if type(v) in PLAIN and k != "training"
            and not k.startswith("_") and (type(v) is not float or math.isfinite(v))}


def changed_attributes(m: nn.Module, at_attach: dict[str, Any] | None
                       ) -> dict[str, int | float | bool]:
    """Those of ``m``'s plain attributes that differ from what they were at attach (or that
    it did not have then)."""
    start = at_attach or {}
    return {k: v for k, v in plain_attributes(m).items()
            if k not in start or type(start[k]) is not type(v) or start[k] != v}
