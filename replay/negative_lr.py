"""A learning rate that went below 0 before the event: a linear decay to 0 (word2vec's
``alpha * (1 - progress)``, ``LambdaLR(lambda s: 1 - s / total)``) run past its end, whose
updates have climbed the loss since. The run looks like one that diverged, but a smaller
learning rate or clipping only slows the climb: the hint names the schedule.
"""

from __future__ import annotations

from typing import Any

from .load import Step

__all__ = ["below_zero", "negative_lr_hint"]


def below_zero(step: Step) -> tuple[str, int, float] | None:
    """(since when, the last such step, its rate) when the ring buffer recorded a learning
    rate below 0 at a step up to the event's (the rate its update took, recorded as the step
    closed); else None."""
    steps, lrs = step.tensors.get("ring/steps"), step.tensors.get("ring/lr")
    at = step.event.get("step")
    if steps is None or lrs is None or lrs.ndim != 2 or not isinstance(at, int):
        return None
    rows = sorted((s, row) for s, row in zip(steps.tolist(), lrs.tolist()) if 0 <= s <= at)
    # (a group's NaN rate, Adafactor's lr=None, is no rate below 0)
    below = [(s, min(v for v in row if v < 0)) for s, row in rows if any(v < 0 for v in row)]
    if not below:
        return None
    (first, _), (last, lr) = below[0], below[-1]
    return (f"from step {first}" if first > rows[0][0] else f"at every step since {first}",
            last, lr)


def negative_lr_hint(step: Step, report: dict[str, Any]) -> None:
    """Add the sentence to ``report["hint"]`` when the learning rate went below 0 (see
    :func:`below_zero`), naming the first such step and the rate at the last one. The
    divergence's advice (a smaller rate, clipping) is not given beside it (see analyze)."""
    found = below_zero(step) if report.get("hint") else None
    if found is None:
        return
    since, last, lr = found
    report["hint"] = (f"{report['hint']}. The learning rate was below 0 {since} ({lr:.3g} at "
                      f"step {last}), so every update since climbed the loss instead of "
                      "descending it: a linear decay to 0 (1 - step / total) run past its end; "
                      "stop the factor at 0 (max(0.0, 1 - step / total)) or give the schedule "
                      "the run's real number of steps; a smaller learning rate or clipping "
                      "only slows the climb")
