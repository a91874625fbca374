"""Whether a finite what-if still diverges: its last loss against the loss the window's
unchanged re-run had before the trouble began.

A try that stays finite through the window's last step may only postpone the event: float64
holds an overflow that a learning rate too high keeps feeding (a ReLU RNN at lr 100, its loss
2.6e154 in float64), clipping bounds each update but not their pace. ``finite through step 3``
alone reads as a fix; the try's loss 10x or more (the precursors' rule) above the median of
the unchanged re-run's losses before the precursors began (else before the event step) says
it is none.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import torch

from .precursors import JUMP


def still_diverging(loss: float | None, window: dict[str, Any] | None) -> dict[str, Any] | None:
    """``{"ratio", "median", "before"}`` when ``loss`` is at least :data:`JUMP` times the
    median finite loss of the window's unchanged steps before the trouble, else None."""
    if loss is None or not window or not math.isfinite(loss):
        return None
    began = window.get("precursors_began") or {}
    before = began.get("step")
    if before is None:
        before = window.get("event_step")
    steps = window.get("per_step") or []
    if before is None and steps:
        before = steps[-1]["step"]
    calm = [s["loss"] for s in steps if before is not None and s["step"] < before
            and s.get("loss") is not None and math.isfinite(s["loss"]) and not s.get("skipped")]
    if not calm:
        return None
    median = statistics.median(abs(v) for v in calm)
    if median <= 0 or abs(loss) < JUMP * median:
        return None
    return {"ratio": abs(loss) / median, "median": median, "before": before}


def diverging_text(d: dict[str, Any]) -> str:
    """The what-if line's words for :func:`still_diverging`'s answer."""
    return (f", {d['ratio']:.3g}x the median {d['median']:.4g} of the unchanged re-run's steps "
            f"before step {d['before']}: still diverging, only later")


def beyond_run_type(loss: float | None, dtype: torch.dtype | None) -> str | None:
    """The run's own floating type (its weights'), when a finite try's loss is beyond that
    type's largest value: a try in a wider type (``dtype=float64``) holds what a run in the
    run's type cannot, so it read "finite" where that run still overflows. None otherwise."""
    if loss is None or dtype is None or not dtype.is_floating_point or not math.isfinite(loss):
        return None
    return str(dtype).removeprefix("torch.") if abs(loss) > torch.finfo(dtype).max else None


def beyond_text(dtype: str) -> str:
    """The what-if line's words for :func:`beyond_run_type`'s answer."""
    return f", beyond {dtype}'s range: a {dtype} run still overflows"
