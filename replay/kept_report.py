"""A backward event that the values the forward keeps aside make (:mod:`replay.kept_aside`):
the re-run of ``loss_fn`` alone makes every gradient finite, with those values added to the
backward it does not; the node that made it is named there."""

from __future__ import annotations

from typing import Any

from .load import Step
from .origins import report_backward
from .rerun import Runner


def report_kept_aside(report, step: Step, runner: Runner) -> dict[str, Any] | None:
    """The report of a backward event made by the values kept aside, None when they make no
    non-finite gradient (or there are none)."""
    runner.keep_aside = True
    try:
        run = runner.run(instrument=False)
        names = [n for n, _ in runner.kept]
        if not names or not run.bad_grads:
            return None
        more = f" +{len(names) - 4} more" if len(names) > 4 else ""
        report["problems"].append(
            "the re-run of loss_fn and backward makes every gradient finite; but the forward "
            f"keeps differentiable values on its modules ({', '.join(names[:4])}{more}), "
            "terms a loop adds to the loss outside loss_fn (a KL, a log prior): "
            "backpropagated too, each weighted 1 (the loop's weights are not recorded), they "
            "make the event")
        out = report_backward(report, runner)
        out["hint"] = (f"{out['hint']}; " if out["hint"] else "") + (
            "return such a term from the model's forward or compute it inside loss_fn, so "
            "that the recorder checks it and the replay re-runs it as the loop weights it")
        return out
    finally:
        runner.keep_aside = False
        runner.kept = []
