"""Weights already non-finite in the guard's copies taken right before an update.

``guard_optimizer=True`` copies the weights as the step closes, just before ``step()``, and
checks them right after it. Weights the update left non-finite that were non-finite in those
copies too were not the update's doing: the loop wrote them after the step's checks passed,
between ``backward()`` and ``optimizer.step()`` (RigL regrowing connections under ``no_grad``
with a scale of 0/0, a pruning mask's division by a zero norm, a dead unit's re-init). That is
a ``weights`` event of the step, written after its forward. Slow path only.
"""

from __future__ import annotations

from typing import Any

import torch

from .events import Event
from .finite import tensors_kind


def written_before_update_event(step: int, bad: list[str], copies: dict[str, Any] | None,
                                renamed: dict[str, str]) -> Event | None:
    """The event for ``bad`` (the update's non-finite weights, by their names now) when every
    one was non-finite in the guard's pre-update ``copies`` (keyed by the names at the copy,
    ``renamed`` maps them to the names now); None otherwise."""
    if not bad or not copies:
        return None
    before = {renamed.get(n, n): w for n, w in copies.get("weights", {}).items()}
    held = [before.get(n) for n in bad]
    if any(w is None or bool(torch.isfinite(w).all()) for w in held):
        return None
    return Event(step, phase="weights", params=list(bad), kind=tensors_kind(held) or "nan",
                 first_seen_step=step, written_after_forward=list(bad),
                 before_update=True,
                 detail=f"non-finite values in {len(bad)} parameter(s), first {bad[0]}, "
                        f"before the update of step {step}, after the step's checks saw its "
                        "forward and backward finite: written between backward() and "
                        "optimizer.step() (an in-place edit of the weights)")
