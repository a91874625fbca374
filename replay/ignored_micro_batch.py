"""A mean loss over no target in one micro-batch of several (gradient accumulation): every
target of that micro-batch is ``ignore_index`` (a parser's gold programs the grammar could not
parse, kept with every action -100; a chunk of padding only), so ``nll_loss``'s mean divides
by a total weight of 0. The op's detail said "every target of the batch", and its advice to
skip such batches; the step's other micro-batches hold targets, so the fix is the
accumulation's: sum each micro-batch's token losses and divide by the whole step's count
(which also weighs every token the same across micro-batches). The samples are the
micro-batch's rows, none of which holds a target: all of them, as without accumulation (a
batch whose every target is ignored), so both read ``all N rows``.

A loop that sums the token losses itself and divides by its micro-batch's own count
(``ce_sum / (labels != -100).sum()``) divides 0 by a 0-d 0 instead: told by a label tensor of
the loss's data that is one negative value (the ignore index) everywhere in that micro-batch
and not in another of the step's. The fix is the same.
"""

from __future__ import annotations

from typing import Any

import torch

from .empty_records import batch_data
from .load import Step
from .recorded import batch_size

_NO_WEIGHT = "total target weight of 0 (0/0)"  # (every target ignored, or weighted 0)
_DETAIL = f"{_NO_WEIGHT}: every target of the batch is ignore"
_DIVIDING = {"aten.div", "aten.div_", "aten.reciprocal"}
_ACCUMULATE = (
    "with gradient accumulation, sum each micro-batch's losses (reduction='sum') and divide "
    "by the count of targets over the whole step, clamped to at least 1, rather than a mean "
    "per micro-batch (which also weighs a token of a short micro-batch more)")


def ignored_micro_batch_hint(report: dict[str, Any], step: Step) -> None:
    """Name the rows of the micro-batch whose every target was ignored or weighted 0, and,
    for ignored ones, that micro-batch in the hint when the step accumulated more than one."""
    o, hint = report.get("origin") or {}, report.get("hint") or ""
    n, i = len(step.micro_batches), o.get("micro_batch") or 0
    if report.get("cause") != "invalid" or i >= max(n, 1):
        return
    if _NO_WEIGHT not in hint:
        if n > 1:
            _own_count(report, step, i, n)
        return
    # (the whole micro-batch, accumulated or not: every row of it, "all N rows")
    rows = list(range(batch_size(step, i)))
    if rows and not o.get("samples"):
        o["samples"] = rows
    if n > 1 and _DETAIL in hint:
        report["hint"] = hint.replace(
            "every target of the batch", f"every target of micro-batch {i} (of {n} this step "
            "accumulated)", 1) + (
            f". The step's other micro-batches hold targets: {_ACCUMULATE}")


def _own_count(report: dict[str, Any], step: Step, i: int, n: int) -> None:
    """A 0/0 division whose micro-batch ``i`` holds a label tensor ignored everywhere while
    the same tensor of another micro-batch of the step is not: the count of its targets."""
    o, hint = report["origin"], report.get("hint") or ""
    if o.get("op") not in _DIVIDING or "0 by 0" not in hint or o.get("phase") == "forward":
        return
    for name, t, _ in batch_data(step, i):
        value = _ignore_value(t)
        if value is None:
            continue
        others = [u for j in range(n) if j != i
                  for other, u, _ in batch_data(step, j) if other == name]
        if others and any(not bool(u.eq(value).all()) for u in others):
            report["hint"] = (
                f"{hint}. Every label of micro-batch {i} (of {n} this step accumulated) is "
                f"{value} (the ignore index) in {name}, and the step's other micro-batches "
                f"hold targets: the count of its targets is the 0 divided; {_ACCUMULATE}")
            return


def _ignore_value(t: torch.Tensor) -> int | None:
    """The one negative value an integer tensor holds everywhere (``-100``), else None."""
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool or not t.numel():
        return None
    first = int(t.reshape(-1)[0])
    return first if first < 0 and bool(t.eq(first).all()) else None
