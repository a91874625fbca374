"""A backward node that multiplied a non-finite value it saved in the forward, which the
forward carried from the batch or a loss target without a non-finite output (saturated by a
tanh, masked, summed away; labels missing as NaN that a ``torch.where`` on the loss skipped):
no pole, the data's. Shared by the backward origin in the model or the loss and the loss
re-run on a value the loop derived from the model's outputs (``replay.derived_args``: a
scaler's ``inverse_transform(out)`` handed to a masked loss)."""

from __future__ import annotations

from recorder.finite import label

from .cause_text import DO, HINTS
from .load import Step
from .recorded import batch_non_finite, input_origin


def saved_input(step: Step, node: str, saved: str | None) -> tuple[list, str] | None:
    """(rows, hint) of the batch tensor or loss target that brought the value ``node`` saved
    (of kind ``saved``); None when it saved only finite values or none of those holds one."""
    if saved is None or not batch_non_finite(step, ("batch/", "loss_in/")):
        return None
    came = input_origin(step)
    target = (came["tensor"] or "").startswith("loss_")
    hint = (f"{node} multiplied a {label(saved)} it saved in the forward, which came in with "
            f"the {'loss target' if target else 'batch'} (rows {came['samples']} of "
            f"{came['tensor'] or 'an input'}) and which the forward carried without a "
            "non-finite output; " + (DO["masked_target"] if target else HINTS["input"]))
    return came["samples"], hint
