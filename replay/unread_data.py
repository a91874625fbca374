"""The recorded loss arguments a forward origin's op could not have read.

A model's forward takes the batch's inputs, not the targets or weights the loop passes to the
loss after it: an overflow inside the model (a scan's cumsum of a decay too large) whose
samples also differ in their targets (a longer sequence's, more of it unpadded) says nothing
about those targets. The data-scale readings (:mod:`replay.outliers`) leave such arguments
out for a forward origin in some rows only; the model run inside the loss (a loss holding the
model, fed the loss's own arguments), the loss's and backward's origins, which the targets do
reach, and an overflow of the whole batch (a run the targets of earlier steps made diverge:
forces in the wrong unit; the re-run without the rows tells) keep them.
"""

from __future__ import annotations

from typing import Any

from recorder.loss_forwards import ran_in_loss

from .load import Step


def loss_only_keys(step: Step, origin: dict[str, Any]) -> frozenset[str]:
    """The bundle keys of micro-batch ``origin``'s loss arguments when the origin is an op of
    the model's own forward, which never took them, non-finite in some rows only; else
    none."""
    mb = origin.get("micro_batch") or 0
    if origin.get("phase") != "forward" or mb >= len(step.micro_batches) \
            or origin.get("all_samples") or not origin.get("samples") \
            or ran_in_loss(step.micro_batches, step.meta.get("loss"), mb):
        return frozenset()
    return frozenset(step.micro_batches[mb].get("loss_paths") or ())
