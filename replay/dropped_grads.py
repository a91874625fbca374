"""Why every parameter's gradient is finite at the step's close while a backward of the step
made a non-finite value: the model's backward dropped it (a ReLU at 0, a mask), or the loop did.

A loop that skips the update on a non-finite gradient norm (ESPnet's and SpeechBrain's
``if not torch.isfinite(clip_grad_norm_(...)): optimizer.zero_grad()``, no ``step()``) drops
that backward's gradients; its next forward is then another micro-batch of the same step (the
recorder marks it ``grads_dropped``), and the gradients the step closes with are those of the
micro-batches after the drop.
"""

from __future__ import annotations

from .load import Step


def finite_params_note(step: Step, mb: int | None, what: str) -> str:
    """The note for a non-finite ``what`` (the loss, or the gradient entering the output) of
    micro-batch ``mb`` whose step closed with every parameter's gradient finite."""
    mbs = step.micro_batches
    later = next((i for i in range(1 + (mb or 0), len(mbs)) if mbs[i].get("grads_dropped")),
                 None)
    if later is None:
        return ("every parameter's gradient stayed finite: the model's backward drops those "
                f"entries (a ReLU at 0, a mask), so the update would have gone ahead while {what} "
                "was non-finite")
    return (f"the step closed with every parameter's gradient finite, but the loop had dropped "
            f"micro-batch {mb or 0}'s gradients (no parameter held one when micro-batch {later} "
            "began: a zero_grad() with no step() between, as a loop does that skips the update "
            f"on a non-finite gradient norm): micro-batch {mb or 0}'s backward is the one named "
            "here, and a loop that skips such updates trains on without the batches it hits")
