"""A loss that differentiates the model: a physics-informed loss takes ``autograd.grad`` of the
output with respect to the inputs (``create_graph=True``), so the model's backward nodes run
inside the loss, and one of them (``SqrtBackward0`` of ``sqrt(x**2 + y**2)`` at the origin)
may make its NaN. The replay names that node and the module whose forward made it, as it does
for the step's own backward."""

from __future__ import annotations

from typing import Any

from .backward import BackwardOrigin, find_backward_origin
from .findings import finish, origin_fields
from .load import Step, differentiates_model
from .recorded import samples
from .rerun import Runner


def node_in_loss(step: Step, runner: Runner, mb: int) -> BackwardOrigin | None:
    """The backward node that made the loss's first non-finite value inside the loss of a
    micro-batch that differentiates the model, None when the loss made it with its own ops."""
    if not differentiates_model(step, mb):
        return None
    b = find_backward_origin(runner, samples(step))
    return b if b.node is not None and b.in_loss and b.micro_batch == mb else None


def loop_differentiation(step: Step) -> str | None:
    """The micro-batches (as words) whose output the loop differentiated itself, outside the
    loss the replay re-runs: a backward with create_graph=True went through the output (a
    gradient penalty, a physics residual computed in the loop), so the step's backward went
    through a term of the loop's that the replay cannot re-run. None when there is none."""
    mbs = [i for i, mb in enumerate(step.micro_batches)
           if mb.get("differentiated") and not differentiates_model(step, i)]
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
