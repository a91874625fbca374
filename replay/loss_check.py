"""The op inside the loss that made a non-finite value its own check then refused: a loss
that warns of a non-finite value and goes on (pytorch-forecasting's ``MultiHorizonMetric``
puts a constant 1e9 in place of a non-finite sum, ``warnings.warn("Loss is not finite")``),
raised as an error by the run's warning filter (``replay.warned_check``), or that raises
itself. The model's output was finite; the recorded step ended inside the loss call, so no
loss output was recorded: the loss is re-run under the op finder, the raise caught."""

from __future__ import annotations

import contextlib

import torch

from .load import Step, autocast_as_recorded
from .loss_args import loss_args
from .ops import OpFinder, OpHit
from .recorded import samples
from .rerun import Runner


def first_in_loss(step: Step, mb: int) -> OpHit | None:
    """The first op of micro-batch ``mb``'s loss that made a non-finite value of finite
    inputs (the re-run's check raising after it), None when there is none or no loss."""
    if step.loss_fn is None:
        return None
    finder = OpFinder(samples=samples(step, mb))
    try:
        run = Runner(step).run(backward=False, instrument=False)
        args, kwargs = loss_args(step, run, mb)
    except Exception:
        return None
    with contextlib.suppress(Exception), torch.no_grad(), autocast_as_recorded(
            step.micro_batches[mb], step.device, loss=True), finder:
        step.loss_fn(*args, **kwargs)  # (raises where the run's check raised)
    return finder.blamed()
