"""Missing targets (NaN) that a loss masks out, in a batch where the mask keeps none: a masked
mean ``((y_hat - y)[m] ** 2).sum() / m.sum()`` (or ``.mean()`` of the empty selection) over a
window with no observation is 0/0. The recorder sees a NaN target and a NaN loss and names the
target (an ``input`` event); re-running the loss under the op finder tells the two apart: an op
of the loss that made NaN of NaN-free values, with no product keeping a target's NaN, made the
loss's NaN itself, and the step is re-run to name that op."""

from __future__ import annotations

from .load import Step
from .masked_targets import watched_loss_rerun


def made_by_the_loss(report, step: Step, origin: dict) -> bool:
    """A loss argument's NaN event whose loss, re-run, made its NaN of NaN-free values (its
    mask dropped every NaN of the argument) rather than passing the argument's NaN on; the
    report's note says so."""
    if not (origin.get("tensor") or "").startswith("loss_") or origin.get("made") != "nan" \
            or step.model is None or step.loss_fn is None:
        return False
    finder = watched_loss_rerun(step, origin.get("micro_batch") or 0)
    if not (finder and finder.first_nan is not None and finder.masked_nan is None):
        return False
    report["problems"].append(
        f"the recorder named {origin['tensor']}, a loss argument holding NaN (rows "
        f"{origin.get('samples')}), beside the NaN loss; the loss re-run drops that NaN and "
        f"makes its own of NaN-free values: {finder.first_nan.op} at {finder.first_nan.source}")
    return True


def loss_reproduced(step: Step) -> bool:
    """A loss origin found in the re-run is the event's: a loss event, or an input event that
    named a loss argument (the NaN the loss made itself, :func:`made_by_the_loss`)."""
    ev = step.event
    return ev.get("phase") == "loss" or (
        ev.get("phase") == "input" and str(ev.get("tensor") or "").startswith("loss_"))
