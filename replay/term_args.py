"""A loss event whose loss only passed on a non-finite value it was given: an argument with an
autograd graph of its own that reaches the model's parameters (the recorder's
``loss_grad_args``), a term the loop computed from the weights and handed to ``loss_fn``
beside the output (``loss_fn(out, y, ewc.penalty(model))``, ``model.kl()``). The bundle holds
its value, not the code that made it."""

from __future__ import annotations

from typing import Any

from recorder.capture import loss_path
from recorder.finite import finite, kind_of

from .findings import finish, origin_fields
from .hidden import report_held_forward
from .load import Step


def report_term_arg(report, step: Step, mb: int, runner=None) -> dict[str, Any] | None:
    """The report of such an event for micro-batch ``mb``'s loss, or None when none of its
    arguments made from the weights is non-finite; with ``runner``, else the forward op that
    made a value the loss held (:func:`replay.hidden.report_held_forward`)."""
    entry = step.micro_batches[mb]
    paths = entry.get("loss_paths") or {}
    for key in entry.get("loss_grad_args") or ():
        t = step.tensors.get(key)
        if t is None or not isinstance(raw := paths.get(key), str) or finite(t):
            continue
        name, made = loss_path(raw), kind_of(t)
        detail = f"{made} in {name}, made from the weights in the loop and given to loss_fn"
        report = finish(report, origin_fields(phase="loss", module="<loss>", micro_batch=mb,
                                              tensor=name, made=made, detail=detail),
                        None, reproduced=True)
        report["hint"] = (
            f"loss_fn was given {name} holding {made}: a term the loop computed from the "
            "model's weights (or values kept beside them) and passed to loss_fn beside its "
            "output (a weight penalty: EWC's or SI's, ewc.penalty(model); a KL, model.kl()); "
            "the loss only passed it on. The bundle holds its value, not the code that made "
            "it: check that code's own state (a Fisher or an importance normalised by a max "
            "or a sum that is 0 for a parameter the task never used: 0/0), or compute the "
            "term inside loss_fn (a loss module holding that state, given the model) so that "
            "the replay re-runs it and names the op")
        return report
    return report_held_forward(report, step, runner, mb) if runner is not None else None
