"""A rollout's gradient, fed back: an autoregressive forecaster's next lead time takes the last
lead's output as its input, so the gradient recorded entering that output holds what the later
lead's backward sent into its input. Non-finite there, while the loss re-runs finite, it is no
loss term outside ``loss_fn``: the later forward's backward made it (the infinite derivative of
``p ** 0.25`` at a forecast the model clamped to 0), and the backward node finder names it."""

from __future__ import annotations

from typing import Any

import torch

from .backward import find_backward_origin
from .backward_report import report_backward
from .load import Step
from .outside import non_finite_entries, recorded_output_grads
from .recorded import samples
from .rerun import Runner
from .run_result import Run


def fed_back(step: Step, run: Run) -> tuple[int, int] | None:
    """(i, j): micro-batch ``i``'s recorded output gradient is non-finite, and a later
    micro-batch ``j`` took that output, value for value as ``run`` re-ran it, as its input."""
    for i, k in non_finite_entries(recorded_output_grads(step)):
        if i >= len(run.outputs) or k >= len(run.outputs[i]):
            continue
        out = run.outputs[i][k].detach()
        for j in range(i + 1, len(run.inputs)):
            if any(isinstance(t, torch.Tensor) and t.shape == out.shape and t.dtype == out.dtype
                   and torch.equal(t.detach(), out) for t in run.inputs[j].values()):
                return i, j
    return None


def report_fed_back(report, step: Step, runner: Runner, run: Run) -> dict[str, Any] | None:
    """The backward origin in the later micro-batch that fed the non-finite gradient into an
    earlier one's output, or None (no output was fed back, or no node made it)."""
    pair = fed_back(step, run)
    if pair is None:
        return None
    i, j = pair
    b = find_backward_origin(runner, samples(step))
    if b.node is None or (b.micro_batch or 0) < j:  # (not in a lead that took the output)
        return None
    report = report_backward(report, runner, b)
    report["problems"].append(
        f"micro-batch {i}'s output is micro-batch {j}'s input (a rollout feeding the model its "
        f"own output): the non-finite gradient recorded entering it came back through the "
        f"backward of micro-batch {j}, named above, not from a loss term outside loss_fn")
    return report
