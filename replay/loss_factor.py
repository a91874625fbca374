"""A gradient entering the model's output that is non-finite in every entry while the loss_fn
the replay re-ran is finite, with finite gradients: the loop multiplied the whole loss by an
infinite factor before ``backward`` (``(loss * scale).backward()``). A hand-written dynamic
loss scaler (fairseq's and Megatron's: double every ``scale_window`` good steps, halve on
overflow) with no cap gets there in a bfloat16 or float32 run, where no overflow ever halves
it: past float32's largest value the scale is inf, and halving inf keeps it inf. One NaN of
the loss's own ops makes NaN in some rows, not ±inf or NaN in every entry."""

from __future__ import annotations

import torch

from .load import Step
from .outside import (
    loop_differentiated_forward,
    loss_fn_not_called,
    output_hooks,
    recorded_output_grads,
)

SCALED = (
    "every entry of the gradient entering the model's output is ±inf or NaN ({n} of {n}) "
    "while the loss_fn re-ran finite with finite gradients: the loop multiplied the whole loss "
    "by an infinite factor before backward ((loss * scale).backward()). A loss scale past "
    "float32's largest value (3.4e38) is inf: a dynamic loss scaler written by hand that "
    "doubles every scale_window good steps with no cap gets there in a bfloat16 or float32 "
    "run, where nothing overflows to halve it, and halving inf keeps it inf (each step after "
    "is skipped). Cap the scale (scale = min(scale * 2, max_scale)), use torch.amp.GradScaler "
    "(and pass it: FlightRecorder(..., scaler=scaler)), or drop loss scaling where the "
    "gradients are not float16")


def infinite_factor_hint(step: Step, mb: int | None) -> str | None:
    """The hint when micro-batch ``mb``'s recorded output gradients are non-finite in every
    entry (some ±inf) and the loss_fn was re-run (see the module doc), else None."""
    if mb is None or step.loss_fn is None or loss_fn_not_called(step) or output_hooks(step) \
            or loop_differentiated_forward(step) is not None:
        return None
    grads = list(recorded_output_grads(step).get(mb, {}).values())
    if not grads or any(bool(torch.isfinite(g).any()) for g in grads) \
            or not any(bool(torch.isinf(g).any()) for g in grads):
        return None
    return SCALED.format(n=sum(g.numel() for g in grads))
