"""What the first training step says, once, when the step's loss went unwatched.

A loss the recorder does not see is neither checked nor recorded: only the gradient it sends
into the model's output is. A loss that is NaN while that gradient is finite (a cross-entropy
whose targets are all ``ignore_index``: 0/0, with zero gradients) then trains on with no event,
the ``loss 1.1, 0.9, nan, 1.0`` of a log nobody reads. Three ways to get there, each said in
the log with its fix when the first training step closes (no event: the gradients still are
checked):

- a plain function given as ``loss_fn`` but called directly, not through ``rec.loss_fn`` (a
  function cannot be hooked);
- a loss module given as ``loss_fn`` that the loop never calls (``F.cross_entropy`` beside the
  ``nn.CrossEntropyLoss`` given, another instance of it); one called outside the step (a
  GradCache's no-grad pass first) was called;
- no ``loss_fn`` at all, no ``rec.record_loss`` and no loss in the model's output (a scalar
  there, as a Hugging Face model returns it): not said where an integration records the
  model, whose trainer computes the loss where the user cannot hand it over, nor for a
  pipeline stage before the last, whose output's gradient comes from the next stage.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from .capture import tensor_leaves
from .pipeline_stage import feeds_next_stage
from .tape import Tape

log = logging.getLogger("nanreplay")

_FUNCTION = ("nanreplay: the loss function given as loss_fn (%s) was not called through "
             "rec.loss_fn in step %d, so its loss is neither checked nor recorded (only the "
             "gradients it sends into the model are): call loss = rec.loss_fn(...), or pass a "
             "loss module, which is hooked where it is")
_MODULE = ("nanreplay: the loss module given as loss_fn (a %s) was not called in step %d, so "
           "the step's loss is neither checked nor recorded (only the gradients it sends into "
           "the model are), and the replay cannot re-run it: compute the loss with that very "
           "object (loss = loss_fn(output, target)), or pass FlightRecorder the loss module "
           "the loop calls, or call rec.record_loss(loss)")
_NONE = ("nanreplay: no loss_fn was given, and step %d's loss is neither checked nor recorded "
         "(only the gradients it sends into the model are): a NaN loss with finite gradients "
         "(a cross-entropy whose targets are all ignore_index) trains on with no event; pass "
         "FlightRecorder(..., loss_fn=criterion) (a loss module, or a function called as "
         "rec.loss_fn), or call rec.record_loss(loss) before backward()")


class LossWatch:
    """The check, armed until the first training step closes. ``kind``: ``"function"``,
    ``"module"`` or ``"none"``; ``seen``: whether the loss module's hook ever ran;
    ``integration``: the name of the integration recording the model, if any."""

    def __init__(self, kind: str, name: str, seen: Callable[[], bool],
                 integration: Callable[[], str | None], model: Callable[[], Any]):
        self.kind, self.name, self.seen, self.integration = kind, name, seen, integration
        self.model = model  # (a pipeline stage before the last has no loss to give)
        self.armed = True

    def step_closed(self, tape: Tape) -> None:
        """A training step with forwards closed: the first says what went unwatched."""
        self.armed = False
        if tape.loss or any(mb.loss_args is not None for mb in tape.micro_batches):
            return
        if self.kind == "function":
            log.warning(_FUNCTION, self.name, tape.step)
        elif self.kind == "module":
            if not self.seen():  # (called, if outside the step: GradCache's no-grad pass first)
                log.warning(_MODULE, self.name, tape.step)
        elif self.integration() is None and not _loss_in_output(tape) \
                and not feeds_next_stage(self.model()):
            log.warning(_NONE, tape.step)


def _loss_in_output(tape: Tape) -> bool:
    """A micro-batch's model output holds a floating scalar: the loss the model computed
    itself (a Hugging Face model given labels), checked as the output is."""
    return any(t.dim() == 0 and t.is_floating_point()
               for mb in tape.micro_batches if mb.outputs is not None
               for t in tensor_leaves(mb.outputs))
