"""A step whose ``loss_fn`` went uncalled: never, or no longer, as the loop swapped its loss.

A loop that changes its loss mid-run (``criterion = FocalLoss()`` after a warm-up, a
curriculum's or schedule's next loss) computes it with an object the recorder was not given:
from then on the steps' losses are neither checked nor kept, and the replay has no loss to
re-run. The ring says when: its ``loss`` column holds a value for each step whose loss_fn was
called and NaN ("not recorded") for the others, so the last step with one is the last call
before the swap. The note and the hint say so, with the fix, instead of only that this step
did not call it.
"""

from __future__ import annotations

import math

from .cached_grads import cached_note, gradient_cached
from .load import Step


def last_called(step: Step) -> tuple[int, int] | None:
    """``(last step whose loss_fn was called, first ring step after it)`` when an earlier
    step of the ring called it and none since did (the event's included), else None."""
    steps, losses = step.tensors.get("ring/steps"), step.tensors.get("ring/loss")
    at = step.event.get("step")
    if steps is None or losses is None or not isinstance(at, int):
        return None
    rows = [(int(s), float(v)) for s, v in zip(steps.tolist(), losses.tolist()) if s <= at]
    called = [i for i, (s, v) in enumerate(rows) if s < at and not math.isnan(v)]
    if not called or called[-1] + 1 >= len(rows):
        return None
    return rows[called[-1]][0], rows[called[-1] + 1][0]


def not_called_note(step: Step) -> str:
    """The note of a step that did not call the loss_fn given."""
    info = step.meta.get("loss") or {}
    if gradient_cached(step):  # (called before the step, on a no-grad pass's outputs)
        return cached_note(step)
    name = info.get("name") or info.get("class")
    head = f"the loss_fn given to the recorder ({name}) was not called in this step"
    if (swap := last_called(step)) is not None:
        last, first = swap
        return (f"{head}: it was called up to step {last} and in none of the steps since "
                f"({first} to {step.event['step']}): the loop computes its loss with another "
                "object since then (a loss swapped mid-run, criterion = FocalLoss() after a "
                "warm-up, a curriculum's next loss), "
                f"which the recorder neither checks nor keeps, so the replay had no loss to "
                f"re-run")
    return (f"{head}, so the replay had no loss to re-run"
            + (": a plain function is seen only when called as rec.loss_fn(...)"
               if info.get("kind") == "function" else ""))


def swapped_hint(step: Step) -> str | None:
    """The hint for a loss swapped after the ring's last call of loss_fn, else None."""
    if (swap := last_called(step)) is None:
        return None
    return (f"the loop stopped calling the loss module given as loss_fn after step {swap[0]}: "
            "keep one loss object for the whole run, given to FlightRecorder, and switch "
            "inside it (an attribute it reads, self.gamma = 2.0, or a module holding the "
            "current loss, self.current = FocalLoss()), or call rec.record_loss(loss) on the "
            "new loss before backward(), so its value is checked; a loss module the recorder "
            "was given is re-run and its op named")
