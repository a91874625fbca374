"""An input event on a batch the loop made from an earlier forward's input gradient (a
Langevin sampler's ``x - step / 2 * g + noise``, an attack's step; see
:mod:`replay.derived_input`), where that gradient itself was non-finite: the model's own
backward w.r.t. its input made it (an energy's ``‖x‖`` at x = 0, whose derivative ``x / ‖x‖``
is 0/0), and the loop's arithmetic only carried it on. The re-run backpropagates each
forward's recorded output gradient into its input, which required grad as in training, so the
backward origin finder names that node, in that micro-batch, and its samples."""

from __future__ import annotations

from typing import Any

from .backward_report import report_backward
from .derived_input import derived_from, maker
from .load import Step
from .rerun import Runner

GRADIENT_NOTE = (
    "{tensor} of micro-batch {i} is no data: the {maker} made it between the step's forwards "
    "from the input of micro-batch {j} and its gradient (torch.autograd.grad w.r.t. the input: "
    "a Langevin sampler's x - step / 2 * g + noise, an attack's step), and the model's "
    "backward made that gradient non-finite: the origin above, which the loop's step only "
    "carried on")


def made_by_input_gradient(report, step: Step, origin: dict[str, Any]) -> dict[str, Any] | None:
    """The report of :mod:`this module <replay.input_grad>`'s case: the backward node of
    micro-batch ``j`` that made its input gradient non-finite; None when the batch is no such
    derived input, the model cannot be re-run, the values hold no NaN (an overflow of the
    loop's own, :func:`replay.derived_input._growing`) or the re-run's first non-finite
    gradient is elsewhere."""
    found = derived_from(step, origin)  # (not after a zero gradient, a growth, an in-place step)
    if found is None or found[1] or found[2] or step.model is None \
            or origin.get("made") != "nan":
        return None
    j = found[0]
    runner = Runner(step)
    rep = report_backward(report, runner)
    o = rep.get("origin") or {}
    if o.get("op") is None or o.get("micro_batch") != j:
        return None
    rep["reproduced"] = True
    rep["problems"].append(GRADIENT_NOTE.format(tensor=origin.get("tensor"),
                                                i=origin.get("micro_batch"), j=j,
                                                maker=maker(step, origin.get("micro_batch"))))
    return rep
