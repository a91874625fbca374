"""A GradScaler event (its scale collapsed, or it skipped too many steps) of a step whose
recorded gradients hold NaN and no infinity: the scaler skips a step for a NaN as for an
overflow, but no scale makes a 0/0 finite (gradient surgery's division by a task gradient's
norm of 0), so it halves its scale at every such step while their updates are lost."""

from __future__ import annotations

import torch

from .load import Step
from .recorded import scaler_state


def nan_skips_text(step: Step) -> str:
    """The hint's sentence for such an event, '' for any other."""
    if step.event.get("kind") != "scale":
        return ""
    grads = [t for k, t in step.tensors.items() if k.startswith("grads/") and t.is_floating_point()]
    if not any(bool(torch.isnan(g).any()) for g in grads) or any(
            bool(torch.isinf(g).any()) for g in grads):
        return ""
    scale = scaler_state(step).get("scale")
    now = f" (now {scale:g})" if isinstance(scale, (int, float)) else ""
    return ("; the GradScaler skipped this step for gradients that are NaN with no infinity "
            "beside them (a 0/0 of the loop's, not an overflow of the scaled loss) and halved "
            f"its scale{now}, as at every step like it, whose update is lost: no scale makes a "
            "0/0 finite, so fix the NaN the loop wrote (the scaler only hides it)")
