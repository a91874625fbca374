"""When an event happened, in the report's words.

An evaluation forward's event is numbered with the next training step ("evaluation forward
before step 4"), except an update's: a non-finite weight an evaluation's check found after
``optimizer.step()`` (the loop evaluated right after the update, as schedule-free optimizers'
``optimizer.eval()`` loops and per-epoch validations do) keeps the step of the update that
wrote it, which came before that evaluation, not after it.
"""

from __future__ import annotations

from typing import Any


def event_when(ev: dict[str, Any]) -> str:
    """``step 3``, ``evaluation forward before step 3`` or ``step 3 (found by the evaluation
    forward after it)``; an update no recorded step held (``replay.unrecorded_update``):
    ``an update before step 0, outside every recorded step``."""
    step = ev.get("step")
    if ev.get("no_step_closed"):
        found = " (found by the evaluation forward after it)" if ev.get("evaluation") else ""
        return f"an update before step {step}, outside every recorded step{found}"
    if not ev.get("evaluation"):
        return f"step {step}"
    if ev.get("phase") == "optimizer":
        return f"step {step} (found by the evaluation forward after its update)"
    if ev.get("no_backward"):
        return f"forward after the last update that no backward followed, before step {step}"
    return f"evaluation forward before step {step}"
