"""A backward event made by terms the re-run of ``loss_fn`` does not differentiate: values
the forward keeps aside (:mod:`replay.kept_aside`), backpropagated beside the loss to name the
node that made it; or a loss argument the loop computed with an autograd graph of its own (a
KL from the weights passed to the loss), of which the bundle holds the value only."""

from __future__ import annotations

from typing import Any

from recorder.capture import loss_path

from .backward_report import report_backward
from .findings import finish, origin_fields
from .load import Step
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
        # (with no loss_fn, the loop's loss may be those values alone: the neural style
        # tutorial sums its modules' self.loss and never uses the output)
        rerun = "the re-run of loss_fn and backward" if step.loss_fn is not None else \
            "the re-run's backward (no loss_fn was recorded)"
        report["problems"].append(
            f"{rerun} makes every gradient finite; but the forward "
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


def report_graph_args(report, step: Step) -> dict[str, Any] | None:
    """The report of a backward event that the re-run (backward from the model output) does
    not make while ``loss_fn`` took arguments with an autograd graph of their own; None when
    it took none."""
    found = [(i, loss_path(raw)) for i, mb in enumerate(step.micro_batches)
             for key in mb.get("loss_grad_args") or ()
             if isinstance(raw := (mb.get("loss_paths") or {}).get(key), str)]
    if not found:
        return None
    params = step.event.get("params") or []
    names = ", ".join(dict.fromkeys(p for _, p in found))
    report["problems"].append(
        f"loss_fn took {names} with an autograd graph of its own, not made from the model's "
        "output: the bundle holds its value, and the re-run's backward, finite, does not "
        "differentiate the code that made it")
    report = finish(report, origin_fields(phase="backward", params=params,
                                          param=(params or [None])[0], micro_batch=found[0][0],
                                          made=step.event.get("kind")),
                    "not_reproduced", reproduced=False)
    report["hint"] = (
        f"the non-finite gradients{' (' + ', '.join(params) + ')' if params else ''} came "
        f"through {names}, a term the loop computed from the model's weights (or values "
        "inside it) and passed to loss_fn beside its output (a KL or a weight penalty: "
        "loss_fn(out, y, model.kl())): its backward made them (a log or sqrt of a weight of exactly 0, a "
        "division by a norm that is 0), in code the replay cannot re-run; compute that term "
        "in the model's forward (returned with the output, or kept on a module) or inside "
        "loss_fn, so that the replay re-runs it and names the op")
    return report
