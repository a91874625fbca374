"""A forward that wrote NaN/Inf into the model's own weights while every value it returned,
the loss and the gradients stayed finite.

TransE-PyTorch renormalises its entities in place at the start of ``forward``
(``weight.data[:-1].div_(weight.data[:-1].norm(p=1, dim=1, keepdim=True))``): a zero row (a
padding entity that no batch looks up) is 0/0 there. No module output holds the NaN, so the
re-run's calls are all finite and the event seemed not to come back; the weights the step's
code wrote (the recorder's ``written_in_step``) are what show it. The op finder then watches
the root's whole call for the op that made them.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from recorder.finite import finite

from .forward import report_forward
from .load import Step
from .rerun import Runner
from .run_result import Call, Run
from .written_notes import written_note
from .written_weights import refill_written

__all__ = ["report_forward_wrote", "report_written_forward"]


def report_written_forward(report, step: Step, runner: Runner, run: Run) -> dict[str, Any] | None:
    """The report of the weights the re-run's forward wrote non-finite (as the recorded
    step's did), named at the op of the root's call that made them; None when it wrote
    none."""
    written = step.written
    params = dict(step.model.named_parameters())
    bad = [n for n in written if n in params and not finite(params[n].detach())]
    root = next((c for c in run.calls if c.module == "" and not c.in_backward), None)
    if not bad or root is None:
        return None
    maker = Call(index=root.index, module="", call=root.call, micro_batch=root.micro_batch,
                 inputs_finite=root.inputs_finite, outputs_finite=False, kind=None,
                 minmax=root.minmax, call_id=root.call_id)
    report = report_forward(report, step, runner, run, maker)
    o = report["origin"]
    if o.get("op") is None:
        return None  # (no op of the root's call made them: another explanation is needed)
    o["params"], o["param"] = bad, o.get("param") or bad[0]
    o["samples"] = []  # (the rows are the weights', not the batch's)
    o["rows"], o["rows_of"] = (rows := _bad_rows(params[bad[0]])), len(params[bad[0]])
    report["reproduced"] = True
    # (the note for a data-dependent init, ActNorm's, which this is not: the origin says it)
    said = written_note(sorted(written))
    report["problems"] = [p for p in report["problems"] if p != said]
    if report["cause"] == "invalid" and "div" in o["op"]:  # (a renormalisation's 0/0)
        report["hint"] = (
            f"{o['op']} wrote {o.get('made')} into rows {rows[:8]} of parameter {bad[0]} in "
            "place, in the forward (a renormalisation through .data): those rows are all 0 (a "
            "padding row, an entity no batch has looked up), so their norm is 0 and 0/0 is "
            "NaN; divide by norm.clamp_min(eps) or use F.normalize (whose eps leaves a zero "
            "row 0), or leave the zero rows out of the write")
    report["problems"].append(
        f"the forward wrote non-finite values into {', '.join(bad)} in place (its outputs "
        "stayed finite): the origin is the op that made them")
    return report


def report_forward_wrote(report, step: Step, bad: list[str]) -> dict[str, Any] | None:
    """Trained weights ``bad`` non-finite when the step began, which the model's own forward
    writes: re-run from the factory's values for their non-finite entries, the forward makes
    them non-finite again. An earlier forward the recorder checks no weights of made them so
    (an evaluation before the first step: TransE-PyTorch's renorm runs in every forward). None
    when the forward does not write them (the usual case: loaded so, written by the loop)."""
    if step.model is None or step.stripped:
        return None
    params = dict(step.model.named_parameters())
    trained = [n for n in bad if n in params and params[n].requires_grad]
    kept, written = {n: params[n].data for n in trained}, step.written
    note = refill_written(step, step.model, trained) if trained else None
    if note is None:
        return None
    step.written = sorted(set(written) | set(trained))
    found = None
    try:
        runner = Runner(step)
        found = report_written_forward(copy.deepcopy(report), step, runner, runner.run())
    except Exception:  # (the weights origin stands without this evidence)
        found = None
    if found is None:
        step.written = written
        for n, data in kept.items():
            params[n].data = data
        return None
    found["problems"][:0] = [note, (
        f"{', '.join(trained)} held NaN/Inf when step {step.event.get('step')} began, and the "
        "model's forward writes them: re-run from finite values, it made them non-finite "
        "again, so an earlier forward did (an evaluation between steps or before the first, "
        "whose weights the recorder does not check)")]
    return found


def _bad_rows(p: torch.Tensor) -> list[int]:
    """The rows (first dimension) of ``p`` holding a NaN/Inf."""
    bad = ~torch.isfinite(p.detach())
    if bad.dim() == 0:
        return [0]
    return bad.reshape(len(bad), -1).any(1).nonzero().flatten().tolist()
