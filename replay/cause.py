"""Why the value went non-finite: invalid math or a dtype's range exceeded.

The step is re-run in float64 (weights converted in place and back, which is lossless for
float16, bfloat16 and float32; autocast off; every op upcast, so casts in the model's own code,
such as a layer run with ``.half()``, compute in float64 too). Still non-finite: the math is invalid whatever
the precision (log of a negative, 0/0, inf - inf). Finite: the value only overflowed the
recorded dtype's range.
"""

from __future__ import annotations

import contextlib

import torch

from .ops import Float64
from .rerun import Runner, StopRun

HINTS = {
    "input": "the batch itself holds NaN/Inf: check the data pipeline for these samples "
             "(bad files, division by zero in normalisation) or filter them before the model",
    "weights": "the weights were already non-finite when the step began, and no recorded "
               "update wrote them: find what writes weights outside optimizer.step() "
               "(checkpoint loading, in-place edits) and resume from an earlier checkpoint",
    "optimizer": "finite gradients became non-finite weights in optimizer.step(): check the "
                 "learning rate and schedule, eps, and clip gradients",
    "invalid": "invalid math that float64 does not fix: guard the op's domain (clamp before "
               "log/sqrt, add eps to denominators, avoid fully masked softmax rows)",
    "overflow": "the value exceeds the dtype's range but is finite in float64: rescale, compute "
                "this op in float32 (outside autocast), lower the learning rate, or clip",
    "not_reproduced": "re-running the step did not give the same result: suspect "
                      "nondeterminism or a transient hardware fault; re-run on another device",
    "loss": "the loss is non-finite from finite model outputs: check the loss inputs "
            "(targets out of range, log of zero probabilities)",
}


@contextlib.contextmanager
def float64(runner: Runner):
    """Run ``runner`` in float64 inside the block; restore every dtype after."""
    model = runner.model
    dtypes = {}
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if t.is_floating_point() and t.dtype != torch.float64:
                dtypes[name] = t.dtype
                t.data = t.data.double()
    saved = runner._buffers
    runner._buffers = {n: (b.double() if b.is_floating_point() else b) for n, b in saved.items()}
    loss = runner.step.loss_fn
    loss_dtypes = {}
    if isinstance(loss, torch.nn.Module):
        for name, b in loss.named_buffers():
            if b.is_floating_point():
                loss_dtypes[name] = b.dtype
                b.data = b.data.double()
    runner.cast = torch.float64
    try:
        yield
    finally:
        runner.cast = None
        runner._buffers = saved
        with torch.no_grad():
            for name, t in list(model.named_parameters()) + list(model.named_buffers()):
                if name in dtypes:
                    t.data = t.data.to(dtypes[name])
                    if t.grad is not None:
                        t.grad = None
            if isinstance(loss, torch.nn.Module):
                for name, b in loss.named_buffers():
                    if name in loss_dtypes:
                        b.data = b.data.to(loss_dtypes[name])


def classify(runner: Runner, phase: str, until: tuple[str, int, int] | None = None) -> str:
    """'invalid' or 'overflow' for a forward, loss or backward origin. ``until``, for a forward
    origin, is its ``(module, call, micro-batch)``: the float64 forward stops after that call,
    as what comes later (made from the origin's value, or another problem) cannot say whether
    the origin's value was invalid math or an overflow."""
    hooks = _stop_after(runner, *until) if phase == "forward" and until else None
    with float64(runner), Float64():
        run = runner.run(backward=phase == "backward", instrument=phase == "forward",
                         hooks=hooks)
    if run.error is not None and not (until and any((c.module, c.call, c.micro_batch) == until
                                         for c in run.calls)):
        raise run.error  # float64 made the model raise before the origin: no answer
    if phase == "forward":  # the origin's own outputs (an earlier -inf mask stays in float64)
        still = any(not c.outputs_finite for c in run.calls
                    if until is None or (c.module, c.call, c.micro_batch) == until)
    elif phase == "loss":
        still = not all(run.loss_finite)
    else:
        still = bool(run.bad_grads)
    return "invalid" if still else "overflow"


def _stop_after(runner: Runner, module: str, call: int, mb: int):
    """Hooks ending a run once call ``call`` of ``module`` in micro-batch ``mb`` returned
    (installed after the instrumentation's, so that call is recorded first)."""
    def hooks(model):
        target = model.get_submodule(module) if module else model
        seen = {"n": 0}

        def post(m, args, output):
            if runner._mb != mb:
                return
            seen["n"] += 1
            if seen["n"] > call:
                raise StopRun

        return [target.register_forward_hook(post)]

    return hooks
