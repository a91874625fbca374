"""The step re-run in float64, up to the origin, for :mod:`replay.cause`: whether the value
is still non-finite when no value is rounded to the model's dtypes.

Weights, buffers and inputs are converted in place and back (lossless for float16, bfloat16
and float32; complex ones to complex128, see :mod:`replay.float64`), autocast is off and every
op upcast, so casts in the model's own code, such as a layer run with ``.half()``, compute in
float64 too. A forward origin's run stops after the origin's module call; the blamed op's call
is captured (:class:`~replay.ops.OpAt`) in that call, or in the loss of its micro-batch.
"""

from __future__ import annotations

import contextlib

import torch

from recorder.capture import tensor_leaves
from recorder.finite import finite
from recorder.numeric_check import check_reason

from .dispatch import Float64, OpAt
from .errors import StopRun
from .float64_loss_args import consistent_loss_args
from .rerun import Runner
from .transforms import outside_transforms


@contextlib.contextmanager
def in_float64(runner: Runner, default: torch.dtype | None = None):
    """The runner's re-runs in float64 inside the block, every op upcast, with the step's
    random draws made in its own type, that of the model's first floating parameter (or
    ``default``): the same numbers as recorded (see draw_as_recorded); a loss that took
    arguments the loop derived from the outputs takes the outputs as the step had them, so
    that its arguments agree (see :mod:`replay.float64_loss_args`)."""
    draw = next((p.dtype for p in runner.model.parameters() if p.is_floating_point()), default)
    with consistent_loss_args(runner), runner.float64(), \
            Float64(draw if draw != torch.float64 else None):
        yield


def float64_still(runner: Runner, phase: str, until, capture: OpAt | None, mb: int) -> bool:
    """Re-run in float64 (forward: up to the origin's call; the blamed op's call captured);
    whether it is still non-finite."""
    window = _Window(runner, *until, capture) if phase == "forward" and until else None
    entering: list[bool] = []  # a backward's gradients entering the model's outputs
    hooks = window.hooks if window else _entering(entering) if phase == "backward" else None
    with in_float64(runner, torch.get_default_dtype()), \
            _watch_loss(runner, capture if phase == "loss" else None, mb):
        try:
            run = runner.run(backward=phase == "backward", instrument=phase == "forward",
                             hooks=hooks)
        finally:
            if window:
                window.close()
    if run.error is not None and not (until and any((c.module, c.call, c.micro_batch) == until
                                         for c in run.calls)):
        if capture is not None and capture.outputs is not None:  # raised after the op (a
            return not all(finite(o) for o in capture.outputs)  # validate_args check)
        if check_reason(run.error) is not None:  # the code's own NaN check fired in float64
            return True  # too (recorder.numeric_check): the value is non-finite there
        raise run.error  # float64 made the model raise before the origin: no answer
    if phase == "forward":  # the origin's own outputs (an earlier -inf mask stays in float64)
        bad = any(not c.outputs_finite for c in run.calls
                  if until is None or (c.module, c.call, c.micro_batch) == until)
        if not bad and capture is not None and capture.outputs is not None:
            # (the op's NaN, masked before the call's output, that a backward node saved: a
            # softmax of a fully masked row zeroed after; finite outputs say nothing of it)
            return not all(finite(o) for o in capture.outputs)
        return bad
    if phase == "loss":
        return not all(run.loss_finite)
    # a loss node's NaN that the model's backward drops (a masked_fill) leaves every
    # parameter's gradient finite: the gradient entering the output tells
    return bool(run.bad_grads) or any(entering)


def _entering(bad: list[bool]):
    """Hooks noting whether each gradient entering the model's outputs is non-finite, and
    each reaching an input that requires grad (a rollout's lead fed the last lead's output:
    the re-run gives it as a leaf, where its backward ends)."""
    def note(grad):
        bad.append(not finite(grad))

    def pre(module, args, kwargs):
        for t in tensor_leaves((args, kwargs)):
            if t.requires_grad and t.is_leaf and t.is_floating_point():
                t.register_hook(note)

    def post(module, args, output):
        for o in tensor_leaves(output):
            if o.requires_grad:
                o.register_hook(note)

    # (calls under a torch.func transform left out: a Jacobian penalty's vmap(jacrev(model))
    # in the loss, whose batched gradients no host read takes)
    return lambda model: [
        model.register_forward_pre_hook(outside_transforms(pre), with_kwargs=True),
        model.register_forward_hook(outside_transforms(post))]


class _Window:
    """Hooks ending a run once call ``call`` of ``module`` in micro-batch ``mb`` returned
    (installed after the instrumentation's, so that call is recorded first), with ``capture``
    active during that call."""

    def __init__(self, runner: Runner, module: str, call: int, mb: int, capture):
        self.runner, self.module, self.call, self.mb = runner, module, call, mb
        self.capture = capture
        self.started = self.ended = 0
        self.active = False

    def hooks(self, model):
        target = model.get_submodule(self.module) if self.module else model

        def pre(m, args):
            if self.runner.micro_batch != self.mb:
                return
            if self.started == self.call and self.capture is not None:
                self.capture.__enter__()
                self.active = True
            self.started += 1

        def closing(m, args, output):  # first of the post hooks: the capture sees no op of
            self.close()                  # the instrumentation's

        def post(m, args, output):
            if self.runner.micro_batch != self.mb:
                return
            self.ended += 1
            if self.ended > self.call:
                raise StopRun

        return [target.register_forward_pre_hook(outside_transforms(pre)),  # (numbered as
                target.register_forward_hook(outside_transforms(closing),  # recorded)
                                             prepend=True),
                target.register_forward_hook(outside_transforms(post))]

    def close(self) -> None:
        if self.active:
            self.active = False
            self.capture.__exit__(None, None, None)


@contextlib.contextmanager
def _watch_loss(runner: Runner, capture: OpAt | None, mb: int):
    """``capture`` active while the loss of micro-batch ``mb`` is computed."""
    fn = runner.step.loss_fn
    if capture is None or fn is None:
        yield
        return

    def watched(*args, **kwargs):
        if runner.micro_batch != mb:
            return fn(*args, **kwargs)
        with capture:
            return fn(*args, **kwargs)

    runner.step.loss_fn = watched
    try:
        yield
    finally:
        runner.step.loss_fn = fn
