"""Weights written non-finite in the step before the optimizer's first update, by the loop
between two micro-batches, not by the forward.

The recorder names the trained weights a step before the first update made non-finite
(``written_in_step``) and the rebuild re-runs them from the factory's values, as a forward
that writes its own weights (ActNorm's data-dependent init, TransE's renorm) makes them again.
A loop that accumulates gradients and writes a weight between micro-batches (a bit flip, a
clamp, a checkpoint load) leaves the same evidence; re-run from the factory's values, no
forward writes them again and the event's module stays finite, which read as weights the
model did not own. When a re-run's forwards do not write those weights, the loop did: the bundle's values, the
ones the event's forward ran with, are put back and the event is the weights' (the reader's
op and rows), written by the loop in that step.
"""

from __future__ import annotations

from typing import Any

import torch

from recorder.finite import finite

from .load import Step
from .origins import report_weights
from .rerun import Runner
from .written_notes import written_note

__all__ = ["report_loop_written"]

_REFILL_NOTE = "the non-finite entries of "  # (replay.written_weights' note)


def _forward_writes(step: Step, bad: list[str]) -> bool:
    """Whether a re-run's forwards (from the refilled values) write any of ``bad``: moved
    or bumped (``FrozenParams``), or non-finite again (through ``.data``: TransE's renorm)."""
    params = dict(step.model.named_parameters())
    before = {n: (params[n].data, params[n].detach().clone()) for n in bad if n in params}
    buffers = [(b, b.detach().clone()) for _, b in step.model.named_buffers()]  # (ActNorm's flag)
    try:
        runner = Runner(step)
        runner.run()
        return bool(set(runner.frozen_written()) & set(bad)) \
            or not all(finite(params[n].detach()) for n in before)
    except Exception:  # (no evidence against the forward's own write: as before)
        return True
    finally:  # (the later re-runs start from the weights as built)
        with torch.no_grad():
            for n, (data, values) in before.items():
                params[n].data = data
                data.copy_(values)
            for buffer, values in buffers:
                buffer.copy_(values)


def report_loop_written(report, step: Step, bad: list[str], written: set[str]
                        ) -> dict[str, Any] | None:
    """The weights report of ``bad`` (non-finite, all named ``written_in_step``) when no
    forward of the step writes them; None otherwise (a forward's own write: re-run)."""
    if not bad or not set(bad) <= written or step.event.get("phase") != "forward" \
            or step.model is None or _forward_writes(step, bad):
        return None
    params = dict(step.model.named_parameters())
    kept = {n: step.tensors.get(f"weights/{n}") for n in bad}
    if any(t is None or n not in params for n, t in kept.items()):
        return None
    with torch.no_grad():
        for n in bad:
            params[n].data = kept[n].to(params[n].device, params[n].dtype)
    said = written_note(sorted(step.written))  # (a forward's write, which this is not)
    step.written = [n for n in step.written if n not in bad]
    step.problems[:] = [p for p in step.problems if not p.startswith(_REFILL_NOTE) and p != said]
    report["problems"] = [p for p in report["problems"]
                          if not p.startswith(_REFILL_NOTE) and p != said]
    out = report_weights(report, step, bad)
    at, mb = step.event.get("step"), step.event.get("micro_batch")
    names = ", ".join(bad[:2]) + (f" (+{len(bad) - 2} more)" if len(bad) > 2 else "")
    it, they = ("it", "it stays") if len(bad) == 1 else ("them", "they stay")
    out["origin"]["micro_batch"] = mb
    rows = (out.get("hint") or "").partition("; only row(s)")[2]
    out["hint"] = (
        f"{names} {'was' if len(bad) == 1 else 'were'} finite when step {at} began (before "
        "the optimizer's first update) and non-finite when its forward of micro-batch "
        f"{mb} ran, and no forward writes {it} (re-run from the factory's values, {they} "
        f"finite): the loop wrote {it} between the step's micro-batches, outside optimizer.step() (an in-place edit, a clamp or a checkpoint "
        "load between gradient accumulation's backward passes); find that write and check "
        "what it writes with torch.isfinite" + (f"; only row(s){rows}" if rows else ""))
    out["problems"].append(
        f"{names}: the bundle holds the values the forward of micro-batch {mb} ran with; "
        "the re-run uses them, since no forward of the step writes them")
    return out
