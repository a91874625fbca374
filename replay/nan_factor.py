"""A NaN gradient entering every sample of every output of the model, from a loss the replay
cannot re-run: one NaN factor scaled the loss as a whole (a task weight the loop computed for
this step: MGDA's min-norm scales after a normaliser of 0, GradNorm's weights), where a bad
record's NaN reaches its own rows only (unless the weights took it in too). Said beside the hint that asks for the loss."""

from __future__ import annotations

import torch

from .load import Step
from .outside import recorded_output_grads
from .recorded import samples

TEXT = (
    "; every sample of {which} received a NaN gradient, where a bad record's NaN reaches its "
    "own rows: one NaN factor likely scaled the loss as a whole, a weight the loop computed "
    "for it at this step (MGDA's min-norm scales, GradNorm's or uncertainty weights), made NaN "
    "by a division by a task's loss or gradient norm that was 0 (a gradient normaliser of 0) "
    "or by a task loss that was NaN itself; check those weights and the task losses with "
    "torch.isfinite before backward, or compute them inside loss_fn so the replay re-runs "
    "them")


def nan_factor_text(step: Step, mb: int | None) -> str:
    """The sentence when each recorded output gradient of micro-batch ``mb`` that holds the
    samples has a NaN in every sample's row (and more than one sample), '' otherwise."""
    where = samples(step, mb) if isinstance(mb, int) else None
    if where is None or where.size < 2:
        return ""
    grads = list(recorded_output_grads(step).get(mb, {}).values())
    seen = 0
    for g in grads:
        d = where.dim(g) if g.is_floating_point() else None
        if d is None or g.shape[d] != where.size:
            continue
        if not bool(torch.isnan(g.movedim(d, 0).reshape(where.size, -1)).any(1).all()):
            return ""
        seen += 1
    if not seen:
        return ""
    which = "each of the model's outputs" if seen > 1 else "the model's output"
    return TEXT.format(which=which)
