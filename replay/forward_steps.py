"""What a step number counts in a loop recorded without an optimizer that calls the model
several times per backward, or whose forwards raised and were caught.

Without an optimizer each root forward is a step, closed by the backward that follows it or,
failing that, by the next forward (docs/guide.md, "What a step is"). A loop that calls the
model once per time step and sums the losses before one backward (the char-RNN tutorials'
cell over a name's letters, a decoder cell recorded alone) then has a step per call: its
event at "step 16" is the fourth name's second letter, which the user, counting iterations,
would look for at step 3. The ring buffer tells it: most steps before the event closed with
no gradient (no backward of their own), some with one. Where every step without one kept no
output of the root call (and those with one kept it), the forward raised and the loop caught
it (BoTorch's fitting closure returns a NaN loss for a failed Cholesky): the note says so,
with the first such step, however few they are (how many of the history's steps failed
follows the optimizer's trajectory, down to the CPU's rounding; that some did does not).
"""

from __future__ import annotations

import math
from typing import Any


def forward_steps_note(meta: dict[str, Any], hist: dict[str, Any]) -> list[str]:
    """The report's note (a list of none or one) when the bundle has no optimizer and some of
    the history's steps before the event had a gradient norm: that forwards raised and were
    caught, when every step before it without one kept no output of its root call (however
    few they are: the count follows the run's trajectory, the fact does not); else that
    steps count calls, with the event's call within its iteration, when at least half had
    none."""
    if meta.get("optimizer"):
        return []
    event = hist.get("event_step")
    before = [(s, g) for s, g in zip(hist.get("steps") or [], hist.get("grad_norm") or [])
              if event is not None and s < event]
    with_grad = [s for s, g in before if g is not None and math.isfinite(g)]
    without = len(before) - len(with_grad)
    if not with_grad:
        return []
    if raised := _raised(hist, event, with_grad):  # (however few: each is a caught raise)
        return [f"recorded without an optimizer, each root forward is a step: {len(raised)} of "
                f"the {len(before)} steps before this one, the earliest recorded step {raised[0]}, ended "
                "without the model's forward returning: it raised and the loop caught the "
                "exception and went on (BoTorch's fit_gpytorch_mll closure turns a failed "
                "Cholesky, NanError or NotPSDError, into a NaN loss for its optimizer and "
                "retries; a try/except around the step), so the recorder kept no output of "
                f"those calls and wrote no bundle for them; step {raised[0]} is where the "
                "model first failed, the event's step is a later one that did not raise"]
    if 2 * without < len(before):
        return []
    last = with_grad[-1]
    return [f"recorded without an optimizer, each root forward is a step: {without} of the "
            f"{len(before)} steps before this one had no backward of their own (the loop calls "
            "the model several times per backward: a recurrent cell over a sequence's time "
            "steps), so step numbers count the model's calls, not the loop's iterations; step "
            f"{event} is call {event - last} since the last backward, which ended step {last}"]


def _raised(hist: dict[str, Any], event: int, with_grad: list[int]) -> list[int]:
    """The steps before ``event`` with no backward whose root call kept no output statistic
    (it raised before returning), when every such step is one and some step with a backward
    kept one (the root's output is one the recorder keeps); else none."""
    layers, rows = hist.get("layers") or [], hist.get("absmax") or []
    if "" not in layers:
        return []
    root, done = layers.index(""), set(with_grad)
    if not any(s in done and a is not None and root < len(a) and a[root] is not None
               for s, a in zip(hist.get("steps") or [], rows)):
        return []
    without = [(s, a) for s, a in zip(hist.get("steps") or [], rows)
               if s < event and s not in done]
    if not without or any(a is None or root >= len(a) or a[root] is not None
                          for _, a in without):
        return []
    return [s for s, _ in without]
