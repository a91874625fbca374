"""A loss event on the loss the loop gave to ``rec.record_loss`` while ``loss_fn``'s own loss of
that micro-batch was finite (the recorder's ``loss_given``): a term the loop added to
``loss_fn``'s loss outside it (EWC's or SI's penalty on the weights, FedProx's proximal term,
an auxiliary loss) made the value, and the bundle holds nothing to re-run that term with."""

from __future__ import annotations

from typing import Any

from .findings import finish, origin_fields
from .hidden import report_hidden_forward
from .load import Step
from .rerun import Runner
from .run_result import Run

NOT_RERUN = "the terms the loop added to loss_fn's loss before record_loss are not in the bundle"


def report_given_loss(report, step: Step, runner: Runner, run: Run) -> dict[str, Any] | None:
    """The report of such an event, when the re-run's ``loss_fn`` loss is finite too (a value
    the forward kept aside for the loop to add, an MoE aux loss, is named first)."""
    ev = step.event
    if not ev.get("loss_given") or not run.loss_finite or not all(run.loss_finite):
        return None
    if (hidden := report_hidden_forward(report, step, runner)) is not None:
        return hidden
    detail = (f"{ev.get('kind') or 'a non-finite value'} in the loss given to rec.record_loss, "
              "while loss_fn's loss was finite")
    report = finish(report, origin_fields(phase="loss", micro_batch=ev.get("micro_batch"),
                                          made=ev.get("kind"), detail=detail),
                    None, reproduced=False)
    report["not_rerun"] = NOT_RERUN
    report["problems"].append(
        "loss_fn's loss was finite in the run and in the re-run; the loss given to "
        "rec.record_loss was not")
    report["hint"] = (
        "the non-finite value is in what the loop added to loss_fn's loss before "
        "rec.record_loss(loss): a penalty on the weights (EWC's Fisher, SI's importance, a "
        "proximal term to a copy of the weights), an auxiliary loss. Check that term's own state "
        "(a normalisation by a max or a sum that is 0 for a parameter the task never used or "
        "that did not move: 0/0), or compute the term inside loss_fn (as a module holding that "
        "state) so the replay re-runs it and names the op")
    return report
