"""An infinity an op made of intended fills alone (a max over a row whose every entry a mask
filled with -inf: ColBERT's MaxSim over a passage with no token left) that reached the model
output, where the loss of that micro-batch re-ran finite: the loss took it as meant
(cross-entropy reads a -inf score as a probability of 0: an empty hard negative), so the
event may be one the user wants allowed. The report says so, with the ``allow_inf`` pattern
of the module whose output held it; a loss made non-finite by it (the -inf was a query's
positive) gets no note, as allowing it would only move the event into the loss."""

from __future__ import annotations

from typing import Any

from .run_result import Run


def note_taken_fill(report: dict[str, Any], run: Run, origin: dict[str, Any]) -> None:
    event = report.get("event") or {}
    chain = origin.get("chain") or []
    made = origin.get("made")
    if made not in ("+inf", "-inf") or event.get("kind") != made or len(chain) < 2 \
            or not chain[0].get("intentional"):
        return
    mb = origin.get("micro_batch") or 0
    if mb not in run.loss_micro_batches or not run.loss_finite[run.loss_micro_batches.index(mb)]:
        return
    module = event.get("module") or ""
    report["problems"].append(
        f"{origin.get('op')} made {made} of {chain[0].get('op')}'s intended fill alone, and "
        f"the loss of micro-batch {mb} re-ran finite with it (a -inf score is a probability of "
        "0 to a softmax: a candidate with every token masked); if that is meant, record with "
        f"FlightRecorder(..., allow_inf=[{module!r}])"
        + (" ('' names the root)" if not module else ""))
