"""A loss that differentiates the model: a physics-informed loss takes ``autograd.grad`` of the
output with respect to the inputs (``create_graph=True``), so the model's backward nodes run
inside the loss, and one of them (``SqrtBackward0`` of ``sqrt(x**2 + y**2)`` at the origin)
may make its NaN. The replay names that node and the module whose forward made it, as it does
for the step's own backward."""

from __future__ import annotations

from typing import Any

import torch

from recorder.capture import tensor_leaves
from recorder.loss_forwards import ran_in_loss

from .backward import BackwardOrigin, find_backward_origin
from .cause_text import DO
from .findings import finish, origin_fields
from .load import Step, differentiates_model
from .recorded import samples
from .rerun import Runner
from .transforms import outside_transforms


def node_in_loss(step: Step, runner: Runner, mb: int) -> tuple[BackwardOrigin, bool] | None:
    """The backward node that made the loss's first non-finite value inside the loss of a
    micro-batch that differentiates the model, None when the loss made it with its own ops;
    and whether it was found by differentiating the output as the loop did instead (the loop
    computed the loss's arguments from the output's derivatives: a physics residual)."""
    entry = step.micro_batches[mb]
    if differentiates_model(step, mb):
        b, probed = find_backward_origin(runner, samples(step)), False
    elif entry.get("differentiated") and entry.get("grad_inputs"):
        b = find_backward_origin(runner, samples(step), probe=_derivatives(runner, mb))
        probed = True
    else:
        return None
    return (b, probed) if b.node is not None and b.in_loss and b.micro_batch == mb else None


def _derivatives(runner: Runner, mb: int):
    """Hooks differentiating micro-batch ``mb``'s output with respect to its inputs that
    require grad, to first and second order (the first 8 columns), as a loop computing a
    physics residual does with autograd.grad(u, x, ones, create_graph=True); no weight's
    gradient changes and nothing is drawn from the RNG."""
    def post(module, args, kwargs, output):
        xs = [t for t in tensor_leaves((args, kwargs)) if t.requires_grad
              and t.is_floating_point()]
        outs = [o for o in tensor_leaves(output) if o.requires_grad and o.is_floating_point()]
        if runner.micro_batch != mb or not xs or not outs:
            return
        anomaly, nan_check = torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()
        runner.in_loss = True
        try:  # (a NaN must reach the nodes' hooks, not raise in anomaly mode's check)
            torch.autograd.set_detect_anomaly(torch.is_anomaly_enabled(), check_nan=False)
            firsts = torch.autograd.grad(outs, xs, [torch.ones_like(o) for o in outs],
                                         create_graph=True, allow_unused=True)
            for x, g in zip(xs, firsts):
                cols = g.reshape(len(g), -1) if g is not None and g.dim() else None
                for j in range(min(8, cols.shape[1]) if cols is not None and g.requires_grad
                               else 0):
                    torch.autograd.grad(cols[:, j].sum(), x, retain_graph=True,
                                        allow_unused=True)
        finally:
            runner.in_loss = False
            torch.autograd.set_detect_anomaly(anomaly, check_nan=nan_check)

    return lambda model: [model.register_forward_hook(outside_transforms(post), with_kwargs=True)]


def probed_report(report, step: Step, origin: dict[str, Any], b: BackwardOrigin
                  ) -> dict[str, Any]:
    """A loss event whose argument the loop computed from the output's derivatives, and a
    node of the model that made a non-finite value when the replay differentiated the output
    as such a loop does: that node is the origin; at its derivative's pole (an input exactly
    0), the cause is invalid."""
    at_pole = b.saved_zero == "0"
    report = finish(report, {**origin, "phase": "loss"}, "invalid" if at_pole else None,
                    reproduced=True, hint=(
                        f"{b.node} made {b.made} at its derivative's pole (an input exactly 0); "
                        + DO["backward_pole"]) if at_pole else None)
    report["problems"].append(
        "the loss was given values the loop computed from the model output's derivatives "
        "(torch.autograd.grad with create_graph=True), which the bundle holds as they were, "
        "not how they were made; differentiating the re-run's output with respect to its "
        f"inputs that require grad, as such a loop does, {b.node} in "
        f"{b.module or 'the model'} made {b.made}; compute that term inside the loss given to "
        "the recorder (rec.loss_fn(out, x, ...)) for the replay to re-run it as it ran")
    return report


def loop_differentiation(step: Step) -> str | None:
    """The micro-batches (as words) whose output the loop differentiated itself, outside the
    loss the replay re-runs: a backward with create_graph=True went through the output (a
    gradient penalty, a physics residual computed in the loop), so the step's backward went
    through a term of the loop's that the replay cannot re-run. None when there is none. A
    forward the loss ran itself (WGAN-GP's critic on the interpolates) was differentiated by
    the loss, which the replay re-runs: no loop's term."""
    mbs = [i for i, mb in enumerate(step.micro_batches)
           if mb.get("differentiated") and not differentiates_model(step, i)
           and not ran_in_loss(step.micro_batches, step.meta.get("loss"), i)]
    if not mbs:
        return None
    return f"micro-batch{'es' if len(mbs) > 1 else ''} {', '.join(map(str, mbs))}"


def not_rerun_term(report, step: Step, where: str) -> dict[str, Any]:
    """A loss or backward event that did not come back: the loop's own derivative term made it,
    which the replay, running the model and ``loss_fn`` only, does not have."""
    phase = step.event.get("phase")
    params = step.event.get("params") or []
    report["problems"].append(
        f"the recorded {phase} event did not come back in the re-run: the loop differentiated "
        f"the model's output itself ({where}: torch.autograd.grad with create_graph=True, "
        "outside loss_fn), and that term, which the step's backward went through, is not in "
        "the bundle; the re-run feeds the model only the gradient the loss sent its output")
    report = finish(report, origin_fields(phase=phase, params=params,
                                          param=(params or [None])[0],
                                          made=step.event.get("kind")),
                    "not_reproduced", reproduced=False)
    report["hint"] = (
        "compute the derivative term (the gradient penalty, the PDE residual) inside the loss "
        "the recorder is given, with the input it differentiates by as an argument "
        "(loss = rec.loss_fn(out, x, y) with x.requires_grad_(True)), so the replay re-runs it "
        "and names the op; meanwhile check that term at this step (a sqrt or a norm of a "
        "gradient that is exactly 0 has an infinite derivative)")
    return report
