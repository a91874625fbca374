"""A loss argument the loop computed whose finite entries are out of scale with the model's own
output beside it: the network that made it grew until it overflowed.

DeiT's distillation takes a teacher's logits; a ``ModelEmaV3`` teacher with ``decay`` above 1
lerps each update with weight ``1 - decay < 0``, away from the model, so its weights grow
geometrically until its logits overflow and their ``log_softmax`` is NaN in most rows. The
rows still finite hold logits of 1e9 where the student's are 1e1: no record is bad, that
network left the scale. Said beside the loss-argument hint when the argument's largest finite
magnitude is :data:`SCALE` times the largest of the model's output, re-run from the bundle.
"""

from __future__ import annotations

from typing import Any

import torch

from .load import Step
from .output_overflow import SCALE
from .recorded import input_key
from .rerun import Runner

# how the loss-argument hint (replay.input_text.LOSS_ARGUMENT) ends
_LOSS_ARGUMENT_END = "fix the data pipeline for these samples"


def _absmax(ts) -> float:
    vals = [float(t.detach().abs().max()) for t in ts
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()
            and bool(torch.isfinite(t).all())]
    return max(vals) if vals else 0.0


def grown_argument_hint(report: dict[str, Any], step: Step) -> None:
    """Add :func:`grown_argument_text` to an input event's loss-argument hint."""
    o, hint = report.get("origin") or {}, report.get("hint") or ""
    if report.get("cause") != "input" or not (o.get("tensor") or "").startswith("loss_") \
            or not hint.endswith(_LOSS_ARGUMENT_END):
        return
    report["hint"] = hint + grown_argument_text(step, input_key(step, o),
                                                o.get("micro_batch") or 0)


def grown_argument_text(step: Step, key: str, mb: int) -> str:
    """``; its finite entries reach ...`` when the argument at ``key`` holds finite values
    :data:`SCALE` times the model's output's largest magnitude, else ``""``."""
    t = step.tensors.get(key) if key else None
    if t is None or not t.is_floating_point() or step.model is None:
        return ""
    fin = t[torch.isfinite(t)]
    if not fin.numel():
        return ""
    big = float(fin.abs().max())
    try:
        run = Runner(step).run(backward=False, instrument=False)
        ref = _absmax(run.outputs[mb]) if mb < len(run.outputs) else 0.0
    except Exception:  # (the loss-argument hint stands alone)
        return ""
    if not ref or big < SCALE * ref:
        return ""
    return (f"; its finite entries reach {big:.3g}, {big / ref:.2g}x the model's own output "
            f"beside it ({ref:.3g}): the network that made it left the scale before it "
            "overflowed, no record did: weights that each update moves further from the "
            "model (an EMA whose decay is above 1 lerps with weight 1 - decay < 0) or a "
            "teacher that diverged")
