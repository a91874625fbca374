"""A forward that ran on weights the loop moved in place between the step's forwards.

SAM (and ASAM) take the gradients of a first forward-backward pass, move the weights to
``w + rho * g / ||g||`` for a second pass and restore them before the base optimizer's
``step()``; the recorder marks such a micro-batch (``weights_moved``). The bundle holds the
weights as restored, so the re-run's later forward runs on other weights, and an event made
there (the move's own NaN: ``rho / ||g||`` is ``inf`` where the first pass's gradients were all
exactly 0, and ``0 * inf`` is NaN) does not come back. The replay says so, and re-runs the
micro-batches before it to tell whether the gradients the move was computed from were all 0.
"""

from __future__ import annotations

import math
from typing import Any

from .findings import recorded_origin
from .load import Step
from .rerun import Runner
from .unseen_weights import report_unseen_weights

__all__ = ["report_moved_weights"]


def report_moved_weights(report, step: Step, runner: Runner) -> dict[str, Any] | None:
    """The report of an event that did not come back in a micro-batch that ran on weights the
    loop had moved (or after one); else that of a call that ran on weights made by code
    the recorder does not see (replay.unseen_weights), else None."""
    moved = [i for i, mb in enumerate(step.micro_batches) if mb.get("weights_moved")]
    at = step.event.get("micro_batch")
    if not moved or (at is not None and at < moved[0]):
        return report_unseen_weights(report, step, runner)
    k = moved[0]
    norm = _grad_norm_before(runner, k)
    report["problems"].append(
        f"micro-batch {k} ran on weights the loop moved in place after the step's earlier "
        "forward and backward (SAM's ascent to w + e, undone before optimizer.step()): the "
        f"bundle holds them as restored, so the re-run's micro-batch {k} ran on other weights "
        "and the event did not come back")
    if norm == 0.0:
        report = recorded_origin(report, step, (
            f"the move made the weights micro-batch {k} ran on non-finite: the gradients it "
            f"was computed from (p.grad after micro-batch {k - 1}'s backward) were all exactly "
            "0, so a step normalised by their norm (SAM's rho / ||g||, ASAM's too) is "
            "0 * inf = NaN; add an eps to the norm (rho / (||g|| + 1e-12)) or skip the move "
            "when the norm is 0"))
        report["cause"] = "weights"
        return report
    return recorded_origin(report, step, (
        "the re-run, on the weights as restored, makes no such value, so the event came with "
        "the loop's move of the weights: check the code that moves them between the forwards "
        f"at this step (its scale, rho / ||g|| with ||g|| = {norm:.3g} here; a rho too large "
        "for the weights)"))


def _grad_norm_before(runner: Runner, k: int) -> float:
    """The norm of the parameters' gradients as micro-batch ``k - 1``'s backward left them
    (summed over the micro-batches before, unless the loop dropped them): what the loop's
    move before micro-batch ``k`` read."""
    squares: dict[int, dict[int, float]] = {}

    def note(p) -> None:
        squares.setdefault(runner.micro_batch, {})[id(p)] = float(p.grad.double().square().sum())

    def hooks(model):
        return [p.register_post_accumulate_grad_hook(note)
                for p in model.parameters() if p.requires_grad]

    runner.run(instrument=False, hooks=hooks)
    return math.sqrt(sum(squares.get(k - 1, {}).values()))
