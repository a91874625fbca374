"""A mean loss over no target in one micro-batch of several (gradient accumulation): every
target of that micro-batch is ``ignore_index`` (a parser's gold programs the grammar could not
parse, kept with every action -100; a chunk of padding only), so ``nll_loss``'s mean divides
by a total weight of 0. The op's detail said "every target of the batch", and its advice to
skip such batches; the step's other micro-batches hold targets, so the fix is the
accumulation's: sum each micro-batch's token losses and divide by the whole step's count
(which also weighs every token the same across micro-batches). The samples are the
micro-batch's rows: none of them holds a target.
"""

from __future__ import annotations

from typing import Any

from .load import Step
from .recorded import batch_size

_DETAIL = "total target weight of 0 (0/0): every target of the batch is ignore"


def ignored_micro_batch_hint(report: dict[str, Any], step: Step) -> None:
    """Name the micro-batch (and its rows) whose every target was ignored, when the step
    accumulated more than one."""
    o, hint = report.get("origin") or {}, report.get("hint") or ""
    n, i = len(step.micro_batches), o.get("micro_batch") or 0
    if report.get("cause") != "invalid" or _DETAIL not in hint or n < 2 or i >= n:
        return
    rows = list(range(batch_size(step, i)))
    report["hint"] = hint.replace(
        "every target of the batch", f"every target of micro-batch {i} (of {n} this step "
        "accumulated)", 1) + (
        ". The step's other micro-batches hold targets: with gradient accumulation, sum each "
        "micro-batch's losses (reduction='sum') and divide by the count of targets over the "
        "whole step, clamped to at least 1, rather than a mean per micro-batch (which also "
        "weighs a token of a short micro-batch more)")
    if rows and not o.get("samples"):
        o["samples"] = rows
