"""An input event whose non-finite root inputs another rank's stage made: under pipeline
parallelism (``torch.distributed.pipelining``) a later stage's root inputs are the activations
the stage before it sent, received as leaves that require grad (its backward sends their
gradient back). Such a rank saw the NaN arrive, not start: the ranks' agreement
(``recorder.ranks``) orders it after the forward event of the rank whose module made it,
where a data input event (a batch of the loader's, which needs no gradient) comes first."""

from __future__ import annotations

import torch

from .capture import tensor_leaves


def received_input(tape, event) -> bool:
    """Every non-finite floating root input of ``event``'s micro-batch is a leaf that
    requires grad (an activation received from another rank's stage)."""
    if event is None or event.phase != "input" or event.module != "" \
            or not isinstance(event.micro_batch, int) \
            or not 0 <= event.micro_batch < len(tape.micro_batches):
        return False
    mb = tape.micro_batches[event.micro_batch]
    bad = [t for t in tensor_leaves((mb.args, mb.kwargs)) if isinstance(t, torch.Tensor)
           and t.is_floating_point() and not bool(t.detach().isfinite().all())]
    return bool(bad) and all(t.requires_grad and t.grad_fn is None for t in bad)
