"""A forward event the recorder named at a call enclosing the re-run's origin because it read
inner calls' inputs through their float32 sum.

The recorder checks an inner call's inputs with one sum each (NaN and +-Inf survive a sum, at
half an aminmax's cost), so finite inputs large enough for their sum to overflow float32 (a
record holding 3e38 features, routed through a mixture of experts' router and experts) read as
non-finite, and the chain's start moves out to the call whose own code made them: the root.
The re-run checks every value and names the op inside it; that is the same event seen closer,
said in a note, not a failure to reproduce.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .load import Step


def summed_inputs_note(step: Step, origin: dict[str, Any]) -> str | None:
    """The note when the recorded event's module encloses ``origin``'s and the origin op took
    finite values whose float32 sum can overflow; else None."""
    ev = step.event
    recorded, found = ev.get("module"), origin.get("module")
    if ev.get("phase") != "forward" or not isinstance(recorded, str) \
            or not isinstance(found, str) or found == recorded \
            or not (recorded == "" or found.startswith(recorded + ".")):
        return None
    lo, hi = origin.get("input_range") or (None, None)
    if lo is None or hi is None or not origin.get("inputs_finite"):
        return None
    top = max(abs(lo), abs(hi))
    if not math.isfinite(top) or top < torch.finfo(torch.float32).max / 2 ** 24:
        return None
    return (f"the recorder named {recorded or '<root>'}, which encloses {found}: it checks an "
            "inner call's inputs by their float32 sum, which overflows on finite values this "
            f"large (up to {top:.3g}), so it took them for non-finite; the re-run checks each "
            "value: the same event, seen closer")
