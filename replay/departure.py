"""Where a rewind window's re-run stops being the run that trained: a step before the event's
whose recorded values (the ring buffer's loss and gradient norm, checked finite when training
ran it) the re-run does not give back. The window re-runs the recorded batches from its copy
with the optimizer; what the loop changed between steps and the copy does not hold (weights
loaded with ``load_state_dict``: a federated round's global weights given to each client in
turn; a loss module's buffers set since: EWC's Fisher consolidated at a task boundary) makes
the re-run another run from there, whose steps say nothing about training's."""

from __future__ import annotations

import math
from typing import Any

from .load import Step

# a gradient norm further than this from the recorded one (relative) is another step's: the
# re-run's arithmetic is the run's, so only a different state moves it this far
_APART = 0.1

CHANGED = ("state the loop changed after the window's copy and that the copy does not hold "
           "makes the difference (weights loaded between steps with load_state_dict, as a "
           "federated round's global weights given to each client; a loss module's buffers "
           "set or replaced since, as EWC's Fisher consolidated at a task boundary; plain "
           "tensor attributes; values outside the batch)")


def departure(step: Step, per_step: list[dict[str, Any]], loop_clip
              ) -> tuple[int, str] | None:
    """The first step before the event's where the re-run is not the run, with the note that
    says so, or None. ``per_step``: the window's statistics, step by step."""
    recorded, event = _recorded(step), step.event.get("step", 0)
    norms = loop_clip is None and not (step.meta.get("rewind") or {}).get("grad_scaler") \
        and int((step.event.get("ranks") or {}).get("world_size") or 1) < 2
    for stats in per_step:
        s = stats.get("step")
        if s is None or s >= event or s not in recorded:
            continue
        (loss, r), g = recorded[s], _number(stats.get("grad_norm"))
        if math.isfinite(loss) and not math.isfinite(_number(stats.get("loss"))):
            # (the recorder checks every step's loss: a non-finite one would have raised)
            return s, (f"training ran step {s} with a finite loss ({loss:.4g}) and no event, "
                       f"so the window's re-run of it is not the step that ran: {CHANGED}; "
                       f"the window says nothing about the steps from {s} on")
        # (norms the re-run takes as the recorder read them: no loop clip, scaler or peers)
        if norms and math.isfinite(g) and math.isfinite(r) \
                and abs(g - r) > _APART * max(abs(g), abs(r)):
            return s, (f"from step {s} the window's re-run is not the run: its gradient norm "
                       f"{g:.4g} where training's was {r:.4g}; {CHANGED}; the window says "
                       f"nothing about the steps from {s} on")
    return None


def tries_note(report: dict[str, Any]) -> str | None:
    """What a what-if re-run of a window that departed from the run proves (nothing), or
    None when the window did not depart."""
    s = (report.get("window") or {}).get("departed")
    if s is None:
        return None
    return (f"the window's re-run is not the run from step {s} (see the note), so neither is "
            "this try's: no evidence of a fix")


def _number(v) -> float:
    """A per-step statistic as a float (``"nan"``, ``"inf"`` as written; None: NaN)."""
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def _recorded(step: Step) -> dict[int, tuple[float, float]]:
    """Each ring step's (loss, gradient norm) as training recorded them."""
    t = step.tensors
    steps, loss, grad = t.get("ring/steps"), t.get("ring/loss"), t.get("ring/grad_norm")
    if steps is None or loss is None or grad is None:
        return {}
    return {int(s): (float(a), float(b)) for s, a, b in zip(steps.tolist(), loss.tolist(),
                                                          grad.tolist())}
