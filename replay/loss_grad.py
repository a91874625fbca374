"""A loss that differentiates the model: a physics-informed loss takes ``autograd.grad`` of the
output with respect to the inputs (``create_graph=True``), so the model's backward nodes run
inside the loss, and one of them (``SqrtBackward0`` of ``sqrt(x**2 + y**2)`` at the origin)
may make its NaN. The replay names that node and the module whose forward made it, as it does
for the step's own backward."""

from __future__ import annotations

from .backward import BackwardOrigin, find_backward_origin
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
