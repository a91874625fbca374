"""What a step number counts in a loop recorded without an optimizer that calls the model
several times per backward.

Without an optimizer each root forward is a step, closed by the backward that follows it or,
failing that, by the next forward (docs/guide.md, "What a step is"). A loop that calls the
model once per time step and sums the losses before one backward (the char-RNN tutorials'
cell over a name's letters, a decoder cell recorded alone) then has a step per call: its
event at "step 16" is the fourth name's second letter, which the user, counting iterations,
would look for at step 3. The ring buffer tells it: most steps before the event closed with
no gradient (no backward of their own), some with one.
"""

from __future__ import annotations

import math
from typing import Any


def forward_steps_note(meta: dict[str, Any], hist: dict[str, Any]) -> list[str]:
    """The report's note (a list of none or one) saying that steps count calls, with the
    event's call within its iteration, when the bundle has no optimizer and at least half of
    the history's steps before the event had no gradient norm while some had one."""
    if meta.get("optimizer"):
        return []
    event = hist.get("event_step")
    before = [(s, g) for s, g in zip(hist.get("steps") or [], hist.get("grad_norm") or [])
              if event is not None and s < event]
    with_grad = [s for s, g in before if g is not None and math.isfinite(g)]
    without = len(before) - len(with_grad)
    if not with_grad or 2 * without < len(before):
        return []
    last = with_grad[-1]
    return [f"recorded without an optimizer, each root forward is a step: {without} of the "
            f"{len(before)} steps before this one had no backward of their own (the loop calls "
            "the model several times per backward: a recurrent cell over a sequence's time "
            "steps), so step numbers count the model's calls, not the loop's iterations; step "
            f"{event} is call {event - last} since the last backward, which ended step {last}"]
