"""An optimizer with ``maximize=True`` whose loss rose until the run broke: gradient ascent on
a loss meant to be minimised (a loss negated for ``maximize=True`` as well, ``-reward`` twice,
or a flag copied from a script that maximises). A smaller learning rate or clipping only
slows the climb, and a wider type postpones its overflow: the hint names the flag.
"""

from __future__ import annotations

import math
from typing import Any

from .load import Step

__all__ = ["ascent_hint"]

# how much the recorded loss must have grown from its first step to its last finite one
ROSE = 10.0


def ascent_hint(step: Step, report: dict[str, Any]) -> None:
    """Add the sentence to ``report["hint"]`` when a parameter group of the bundle's optimizer
    has ``maximize=True`` and the loss the ring recorded rose ``ROSE``-fold or more from its
    first step to its last finite one (steps the event came at or after: the climb's)."""
    groups = (step.meta.get("optimizer") or {}).get("param_groups") or []
    if not any(g.get("maximize") is True for g in groups) or not report.get("hint"):
        return
    steps, losses = step.tensors.get("ring/steps"), step.tensors.get("ring/loss")
    if steps is None or losses is None:
        return
    rows = sorted((s, v) for s, v in zip(steps.tolist(), losses.tolist())
                  if math.isfinite(v) and s >= 0)
    if len(rows) < 2 or not rows[0][1] > 0 or rows[-1][1] < ROSE * rows[0][1]:
        return
    (s0, a), (s1, b) = rows[0], rows[-1]
    report["hint"] = (f"{report['hint']}. The optimizer has maximize=True, so every update "
                      f"climbs what the loss returns, and it rose from {a:.3g} at step {s0} to "
                      f"{b:.3g} at step {s1}: if that loss is to be minimised (one negated for "
                      "maximize=True as well, -reward twice), drop maximize=True; a smaller "
                      "learning rate only slows the climb")
