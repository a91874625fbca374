"""Weights the loop wrote non-finite between a step's backward and its ``optimizer.step()``.

With ``guard_optimizer=True`` the recorder copies the weights right before each update; where
the update's non-finite weights were so in those copies already, after the step's forward and
backward were checked finite, the event is theirs (:mod:`recorder.pre_update`): code between
``backward()`` and ``step()`` wrote them in place (RigL / SET regrowing connections with a
scale of 0/0, a re-initialised dead unit's std of one value or none). The bundle holds them as
that code left them; the step ran on the weights before it, so nothing is re-run.
"""

from __future__ import annotations

from typing import Any

import torch

from .findings import finish, origin_fields
from .load import Step

__all__ = ["written_before_update"]


def written_before_update(report, step: Step) -> dict[str, Any]:
    """The report of a ``weights`` event the recorder found in the guard's pre-update copies:
    the parameters, their non-finite rows, and the code between backward and step blamed."""
    ev = step.event
    params = list(ev.get("params") or [])
    name = params[0] if params else None
    w = step.tensors.get(f"weights/{name}")
    rows: list[int] = []
    if w is not None and w.dim():
        rows = (~torch.isfinite(w)).reshape(len(w), -1).any(1).nonzero().flatten().tolist()
    at = ev.get("step")
    more = f" (+{len(rows) - 8})" if len(rows) > 8 else ""
    where = f" in rows {rows[:8]}{more}" if rows else ""
    report["problems"].append(
        f"{name} was finite when step {at}'s forward and backward ran (the step's checks "
        f"passed) and non-finite{where} in the copy taken right before its optimizer.step(): "
        "the bundle holds it as the loop's code between them left it, so the step is not "
        "re-run")
    report["not_rerun"] = "weights written after its forward"
    origin = origin_fields(phase="weights", param=name, params=params, made=ev.get("kind"),
                           rows=rows, rows_of=len(w) if w is not None and w.dim() else 1)
    return finish(report, origin, "weights", reproduced=False, hint=(
        f"the loop wrote {ev.get('kind') or 'non-finite values'} into {name}{where} between "
        f"step {at}'s backward() and its optimizer.step(), not the update: check the code "
        "there that writes weights in place (pruning and regrowing connections: a new "
        "value's scale divided by a count or norm of 0; a re-initialised unit's std of one "
        "value or none; a mask applied by division): clamp the divisor (clamp_min(1), "
        "clamp_min(eps)) or skip the rows where it is 0"))
