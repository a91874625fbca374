"""A model that is one stage of a ``torch.distributed.pipelining`` schedule.

The schedule's first step infers the shapes passed between stages by running each stage's
forward (and the last stage's loss) on ``torch.empty`` buffers: uninitialised memory, no step
of the run, so the recorder pauses through it as through a shape pass on the meta device
(a NaN in that garbage was a step-0 event on a healthy run, and shifted every real step 0's
micro-batches by one). A stage other than the last computes no loss: its output's gradient
comes from the next stage, so "no loss_fn was given" is no advice it can follow.
"""

from __future__ import annotations

import gc
import sys

from torch import nn

from .compat import called_within, pipeline_stage_class

_PIPELINING = "torch.distributed.pipelining"
_INFERENCE = frozenset(("_forward_metadata_inference", "_backward_metadata_inference"))


def in_shape_inference() -> bool:
    """Whether a pipeline stage's shape inference runs this call (nothing to pay where the
    pipelining package was never imported)."""
    # (the stage's inference calls the module a few frames below)
    return _PIPELINING in sys.modules and called_within(_INFERENCE, 16)


def feeds_next_stage(model: nn.Module | None) -> bool:
    """Whether ``model`` is the module of a pipeline stage other than the last (looked up
    once, when the first training step closes with no loss seen)."""
    if _PIPELINING not in sys.modules or model is None:
        return False
    stage = pipeline_stage_class()
    if stage is None:
        return False
    # (the stages holding it, from its referrers: a scan of every object in Python was 0.2 s
    # in a large process. By type: isinstance reads an object's __class__, which some objects
    # answer with a warning, torch.distributed's deprecated reduce_op)
    held = []
    for r in gc.get_referrers(model):
        if issubclass(type(r), stage):  # (an instance whose attributes live inline)
            held.append(r)
        elif type(r) is dict and r.get("submod") is model:  # (one with a __dict__)
            held += [o for o in gc.get_referrers(r) if issubclass(type(o), stage)]
    return any(o.submod is model and not o.is_last for o in held)
