"""The forward line of a backward node the loss ran (a contractive penalty's
``jacobian(encoder, x, create_graph=True)``: ``SqrtBackward0`` made in the encoder's forward,
run by the loss's own ``autograd.grad``). The loss's re-run keeps no traceback on the nodes it
makes, so the node's forward line was unknown and the report named only the loss's line that
took the derivative; the loss is run once more under :func:`replay.source.node_tracebacks`,
only for such an origin, and the same op's node read there."""

from __future__ import annotations

from .forward_grad import derivative_words
from .load import Step, autocast_as_recorded
from .loss_args import loss_args
from .loss_maker import loss_op_finder
from .ops import OpHit
from .rerun import Runner
from .run_result import Run
from .source import node_tracebacks


def loss_node(step: Step, runner: Runner, run: Run, mb: int, moved, hit: OpHit | None,
                    made: str | None) -> tuple[str, str | None, str] | None:
    """:func:`replay.forward_grad.derivative_words` of the loss's node that ran ``hit``'s
    op, its forward line read off a re-run with tracebacks; None for an op of the loss's own."""
    if hit is None or hit.node is None:
        return None
    again = _same_op_again(step, runner, run, mb, moved, hit, made)
    return derivative_words(hit, again, "the loss's")


def _same_op_again(step: Step, runner: Runner, run: Run, mb: int, moved, hit: OpHit,
                   made: str | None) -> OpHit | None:
    """``hit``'s op found again in a re-run of the loss under anomaly mode's tracebacks (no
    NaN check); None when it differs or the loss cannot run twice (a graph it freed)."""
    finder = loss_op_finder(runner)
    try:
        args, kwargs = loss_args(step, run, mb, finder, moved)
        with autocast_as_recorded(step.micro_batches[mb], step.device, loss=True), \
                node_tracebacks(), finder:
            step.loss_fn(*args, **kwargs)
    except Exception:  # (the first run's finding stands, without the line)
        return None
    again = finder.blamed(made)
    if again is None or again.node is None or again.op != hit.op \
            or again.node.name() != hit.node.name():
        return None
    return again
