"""The loss's arguments in the float64 re-run, consistent with each other.

The float64 re-run recomputes the model's outputs in float64, but a loss argument the loop made
from them (the recorder's ``loss_grad_args``: a batch-hard miner's ``e[pos]``, a flip-test
average) is the bundle's recorded value, made from the step's own outputs by code the bundle
does not hold. Given side by side, they are no longer the same numbers: a positive that *is*
its anchor (a sample alone in its label class) differs from the float64 anchor by the float32
rounding, and the loss's ``anchor - positive`` that is exactly 0 in the step, and in exact
arithmetic, is not 0 there.

So where a micro-batch's loss took such arguments, the float64 re-run gives that loss every
model output at its value in the step's own precision (a plain re-run's, the same as the
recorded run's), cast to float64 like the recorded arguments, while the gradient still flows
into the float64 model's output: all of the loss's arguments then come from the same values,
and the loss computes in float64 on them.
"""

from __future__ import annotations

import contextlib

import torch

from .rerun import Runner


def derived_micro_batches(runner: Runner) -> set[int]:
    """The micro-batches whose loss took a floating argument the loop made from the model's
    outputs (``loss_grad_args`` the bundle holds)."""
    step = runner.step
    if step.loss_fn is None:
        return set()
    return {i for i, mb in enumerate(step.micro_batches)
            if any(isinstance(t := step.tensors.get(k), torch.Tensor) and t.is_floating_point()
                   for k in mb.get("loss_grad_args") or ())}


@contextlib.contextmanager
def consistent_loss_args(runner: Runner):
    """Inside the block (around the runner's float64 re-runs), the loss of each micro-batch
    :func:`derived_micro_batches` names takes the model's outputs at the values of a plain
    re-run made before it, in float64, with the gradient passing to the float64 outputs."""
    mbs = derived_micro_batches(runner)
    if not mbs or runner.loss_outputs is not None:
        yield
        return
    run = runner.run(backward=False, instrument=False)  # (the step's own precision)
    values = {i: [o.detach() for o in run.outputs[i]] for i in mbs if i < len(run.outputs)}

    def swap(i: int, outputs: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        return [[_as_value(o, values[k][j]) if k in values and j < len(values[k]) else o
                 for j, o in enumerate(outs)] for k, outs in enumerate(outputs)] \
            if i in values else outputs

    runner.loss_outputs = swap
    try:
        yield
    finally:
        runner.loss_outputs = None


def _as_value(o: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` in ``o``'s dtype, differentiable as ``o`` (the identity's gradient); ``o``
    itself when the two do not match (another shape, not floating)."""
    if not (isinstance(o, torch.Tensor) and o.is_floating_point() and value.is_floating_point()
            and o.shape == value.shape):
        return o
    v = value.to(o.device, o.dtype)
    return _AsValue.apply(o, v) if o.requires_grad else v


class _AsValue(torch.autograd.Function):
    """Forward: the value given; backward: the incoming gradient, to the tensor it stands for."""

    @staticmethod
    def forward(ctx, o, value):
        return value.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None
