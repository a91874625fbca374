"""A micro-batch the loop skipped after its forward (``if not torch.isfinite(loss):
continue`` before ``backward()``, no ``step()``; an ``except`` around a loss that raised, which
goes on to the next batch): its step stays open, so its event is found
when the *next* batch's ``optimizer.step()`` closes the step, and is raised there, where a loop
that catches ``NonFiniteError`` to skip the bad batch drops a good one. Said in the event's
message, with the call that closes the step at the skipped batch. A micro-batch run in eval mode
with gradients on and no backward is a validation forward run without ``torch.no_grad()``
instead (``.eval_with_grad``), which the note says."""

from __future__ import annotations

from typing import Any

from .eval_with_grad import eval_with_grad_note, ungraded_eval


def skipped_note(tape: Any, micro_batch: int | None) -> str:
    """The note for an event in ``micro_batch`` of ``tape``'s training step when no backward
    ran through it while a later micro-batch's did (gradient accumulation runs each one's
    backward before the next forward); empty otherwise."""
    mbs = getattr(tape, "micro_batches", None) or []
    if micro_batch is None or tape.evaluation or not 0 <= micro_batch < len(mbs):
        return ""
    mb = mbs[micro_batch]  # (its loss ran: a forward kept only as a detached target did not)
    if ungraded_eval(mb.training, mb.grad_enabled,
                     bool(mb.out_grads or mb.differentiated)):
        note = eval_with_grad_note(micro_batch, getattr(tape, "step", None))
        return f" {note[0].upper()}{note[1:]}."
    if mb.out_grads or not mb.grad_enabled or mb.loss_args is None:
        return ""
    if not any(m.out_grads for m in mbs[micro_batch + 1:]):
        return _rewound_note(micro_batch) if getattr(tape, "updated_elsewhere", False) else ""
    if not any(m == micro_batch for m, _, _ in getattr(tape, "loss", ())):
        return _raised_note(micro_batch)  # (its loss call took arguments and never returned)
    return (f" Micro-batch {micro_batch}'s loss went through no backward while a later "
            "micro-batch's did: the loop skipped that batch after its loss (`if not "
            "torch.isfinite(loss): continue` before backward()), which leaves the step open, so "
            "the event was found at a later batch's step(), and the recorder's step numbers "
            "fall behind the loop's. Call rec.end_step() before the `continue`: the skipped "
            "batch is then a step of its own, and its event comes there.")


def _raised_note(micro_batch: int) -> str:
    """The note when micro-batch ``micro_batch``'s loss call raised (a target out of range, a
    masked loss refusing an empty mask) and the loop's ``except`` went on to the next batch."""
    return (f" Micro-batch {micro_batch}'s loss call raised and never returned, and a later "
            "micro-batch's backward ran: the loop caught that exception and went on to the "
            "next batch, which leaves the step open, so the event was found at a later "
            "batch's step(), and the recorder's step numbers fall behind the loop's. Call "
            "rec.end_step() in the `except` before going on: the skipped batch is then a step "
            "of its own, and its event comes there.")


def _rewound_note(micro_batch: int) -> str:
    """The note when micro-batch ``micro_batch``'s loss went through no backward and the
    weights were then written outside ``step()`` before the next forward: the loop stopped at
    that loss and put saved weights back (``load_state_dict``), as a learning-rate range test
    does when its loss diverges on purpose."""
    return (f" Micro-batch {micro_batch}'s loss went through no backward, and the weights were "
            "then written outside optimizer.step() before the next forward (a load_state_dict "
            "restoring saved weights?): the loop stopped at that loss and rewound, as a "
            "learning-rate range test does when its loss diverges. Run a loop that drives the "
            "loss to Inf/NaN on purpose unrecorded, inside `with rec.paused():` (the steps "
            "after it are numbered on from the last recorded one); a loop that skips a bad batch calls rec.end_step() before going "
            "on.")
