"""Updates by an optimizer the recorder was not given (one made after it, for a second phase).

The recorded optimizer's ``step()`` closes every step; when the loop steps another one, no
step ever closed: nothing was checked and the open step kept every batch alive, up to
``max_micro_batches`` of them. One weight the recorded optimizer holds (``Target.watched``) is
watched by its version counter (a Python attribute read, no device work): moved in place
while a step is open and outside the recorded ``step()``, it says another optimizer stepped.

A loop may also move the weights itself between a step's forwards and then step the recorded
optimizer: SAM perturbs them to ``w + e`` for a second forward and backward, restores them and
steps its base optimizer. The first move closes the step as another optimizer's would; once the
recorded optimizer steps after such a move, moves are the loop's own edits and close nothing
more. The warning waits for a second move with no recorded step between.

A loop that accumulates gradients may write the weights between two micro-batches of a step (a
bit flip, a clamp, a checkpoint load). The step before had more micro-batches than this one
has yet, all closed by the recorded optimizer, and the ones this step ran left their gradients
held: such a move is the loop's write, not another optimizer's update (which comes after as
many micro-batches as the step before had, and is seldom seen with gradients still held:
``zero_grad()`` drops them before the next forward). It is absorbed, the step stays open, and
its weights are those after the write, as a write into a weight not watched would leave them.
"""

from __future__ import annotations

import logging

import torch

from .compat import version_of
from .tape import Tape

log = logging.getLogger("nanreplay")

WARNING = ("nanreplay: the model's weights were updated but the optimizer given to "
           "FlightRecorder never stepped: the loop steps another optimizer (one created after "
           "the recorder?). Each forward now closes the step, after the update, so gradients "
           "are not checked and a bad update is not stopped: give FlightRecorder the optimizer "
           "the loop steps (a wrapper whose own methods step an optimizer it holds, SAM's "
           "first_step() and second_step(): that one, FlightRecorder(model, "
           "optimizer.base_optimizer)).")


class ForeignUpdates:
    """Whether the weights moved under an open step by another optimizer's hand."""

    def __init__(self):
        self.stepping = False  # the recorded optimizer's step() is running
        self._warned = False
        self._moved = False  # a move closed a step since the recorded optimizer's last step()
        self._own_edits = False  # the recorded optimizer stepped after one: the loop's edits
        self._open: Tape | None = None  # the training step opened last, until it is stepped
        self._micro_batches = 0  # how many the step the recorded optimizer closed last had

    def release(self) -> None:
        """Let go of the open step (at detach)."""
        self._open = None

    def opened(self, tape: Tape, watched: torch.Tensor | None) -> None:
        if watched is not None:
            tape.held_version = version_of(watched)
            if not tape.evaluation:
                self._open = tape

    def stepped(self, tape: Tape | None, watched: torch.Tensor | None) -> None:
        """The recorded step() returned: its own updates moved the weights of a step its
        closure opened (LBFGS evaluates again after updating), which is no sign of another
        optimizer."""
        self.stepping = False
        self._own_edits = self._own_edits or self._moved  # (SAM's perturbation)
        self._moved = False
        if self._open is not None:  # (the step it closed; let go of its batches)
            self._micro_batches = len(self._open.micro_batches)
            self._open = None
        if tape is not None:
            self.opened(tape, watched)

    def moved(self, tape: Tape, watched: torch.Tensor | None) -> bool:
        """Another optimizer updated the weights since ``tape`` opened (said once); the tape
        is marked: the weights a bundle of it holds are not those its forward used."""
        if watched is None or tape.held_version is None or self.stepping \
                or version_of(watched) == tape.held_version or self._absorbs(tape, watched) \
                or self._own_edits:
            return False
        tape.updated_elsewhere = True
        self._open = None  # (it closes now, not by the recorded optimizer)
        if self._moved and not self._warned:
            self._warned = True
            log.warning(WARNING)
        self._moved = True
        return True

    def _absorbs(self, tape: Tape, watched: torch.Tensor) -> bool:
        """The move is the loop's write between micro-batches of a step (see the module's
        docstring): the step's weights are now those after it."""
        if self._moved or watched.grad is None or tape.evaluation \
                or len(tape.micro_batches) >= self._micro_batches:
            return False
        tape.held_version = version_of(watched)
        return True
