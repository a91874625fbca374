"""The one-paragraph message of :class:`~recorder.NonFiniteError`, from a bundle's event."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .constraints import constraint_summary
from .finite import label
from .linalg import linalg_summary
from .loss_forwards import forward_in_loss_phrase
from .missing import allow_nan_advice
from .tied import tied_words


def summary(event: dict[str, Any], path: Path | None) -> str:
    """The one-paragraph message of :class:`~recorder.NonFiniteError`."""
    if event.get("reason") == "linalg":
        return linalg_summary(event, path)
    if event.get("reason") in ("constraint", "check"):
        return constraint_summary(event, path)
    where = ""
    mb = forward_in_loss_phrase(event.get("micro_batch"), bool(event.get("forward_in_loss")))
    if event.get("module") == "<loss>":
        where = (f" Made in the loss (filed under {mb})." if event.get("forward_in_loss")
                 else f" Made in the loss of {mb}.") + (
            " The loss is torch.compile'd: the replay runs it eagerly." if event.get("compiled")
            else "")
    elif event.get("phase") == "input" and event.get("module") is not None:
        # (the batch brought it: no module made it, and "whose inputs were finite" is moot)
        name = event["module"] or "<root>"
        where = f" It came in with the input of '{name}' ({mb})."
        if not event.get("tensor") and event.get("detail"):  # (no tensor holds it now: why)
            where += f" {event['detail'][0].upper()}{event['detail'][1:]}."
    elif event.get("module") is not None:
        name = event["module"] or "<root>"
        where = (f" First made by module '{name}' ({event.get('module_type')}, call "
                 f"{event.get('call')}, {mb})"
                 + (", whose inputs were finite." if event.get("inputs_finite") else ".")
                 + (" It is torch.compile'd: its layers are not recorded one by one."
                    if event.get("compiled") else ""))
    if event.get("tensor"):
        rows = event.get("samples")  # none: a tensor every sample uses (a mask passed in)
        where += (f" Tensor {event['tensor']}, {_samples(rows, event.get('batch_size'))}."
                  if rows else f" Tensor {event['tensor']} (not per sample).")
    if event.get("nan_handled"):
        advice = allow_nan_advice(event["nan_handled"])
        where += f" {advice[0].upper()}{advice[1:]}."
    if event.get("params"):
        params = event["params"]
        more = f" (+{len(params) - 4} more)" if len(params) > 4 else ""
        tied = event.get("tied") or {}  # (one tensor under several names: say them all)
        named = [p + tied_words(tied.get(p, [])) for p in params[:4]]
        where += f" Parameters: {', '.join(named)}{more}."
    if event.get("state") or event.get("statistic"):  # (state_check; running_stats)
        where += f" {event['detail'][0].upper()}{event['detail'][1:]}."
    when = (f"at step {event['step']}" if not event.get("evaluation")
            else f"in a forward with gradients on that no backward followed, after the last "
                 f"update (checked as the recorder detached), before step {event['step']}"
            if event.get("no_backward")
            else f"in an evaluation forward (gradients off) before step {event['step']}")
    head = (f"nanreplay: non-finite value ({label(event.get('kind')) or 'NaN/Inf'}) {when}, "
            f"phase {event['phase'] or 'unknown'}.{where}")
    if event["phase"] is None and event.get("detail"):
        head += f" {event['detail'][0].upper()}{event['detail'][1:]}."
    if path is None:
        return head
    return f"{head} Bundle: {path}; run `nanreplay {path}` to find the op and the cause."


def _samples(rows: list[int], size: int | None) -> str:
    """The rows an event names: "all 32 samples" when they are the whole batch (a column of
    the data, not a record, is bad), else the first 8 and how many more."""
    if size and len(rows) == size > 1:
        return f"all {size} samples"
    more = f" (+{len(rows) - 8} more)" if len(rows) > 8 else ""
    return f"samples {rows[:8]}{more}"
