"""Weights the loop's own rule (no optimizer's) grew step after step until they overflowed.

A Hebbian layer updated in place under ``torch.no_grad()`` (``w += lr * h.T @ x``) with no
decay or normalisation, or Oja's rule at a rate past its stable range, grows its weights by a
factor each step; the first non-finite element is only where that ended. The ring's absmax of
the module holding them, rising over the recorded steps, tells this from one bad coefficient
(an EMA's non-finite momentum), which the frozen-weights hint otherwise suspects."""

from __future__ import annotations

from typing import Any

from .load import Step
from .precursors import history
from .recurrence import grew

# the least steps of history: a rule past its stable range (Oja's at too high a rate) grows
# the weights a thousandfold a step, and overflows within a few
LEAST_STEPS = 4


def grown_rule_hint(step: Step, bad: list[str]) -> str | None:
    """The hint's end when the output of the module holding a parameter of ``bad`` grew
    steadily (:func:`replay.recurrence.grew`) over the recorded steps before the event."""
    hist = history(step.meta, step.tensors)
    owners = {n.rpartition(".")[0] for n in bad}
    for i, layer in enumerate(hist.get("layers") or []):
        if layer not in owners:
            continue
        sizes = [(s, row[i]) for s, row in zip(hist["steps"], hist["absmax"])
                 if row[i] is not None and s != hist["event_step"]]
        d = grew(sizes, LEAST_STEPS)
        if d is not None:
            return _text(layer, d)
    return None


def _text(layer: str, d: dict[str, Any]) -> str:
    return (f"; but the output of {layer} grew from {d['first']:.3g} (step {d['from_call']}) "
            f"to {d['last']:.3g} (step {d['to_call']}), step after step: that update grew "
            "its weights without bound rather than writing one bad value (a Hebbian rule "
            "without a decay term or normalisation, Oja's or a BCM rule at a rate past its "
            "stable range): bound the rule (Oja's decay -y^2 w, renormalise the rows after it "
            "w /= w.norm(dim=1, keepdim=True), clamp the weights) or lower its rate")
