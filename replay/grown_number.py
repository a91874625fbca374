"""A number attribute the loop grew past the range of the type the step computes in.

An augmented Lagrangian multiplies its penalty weight ``rho`` by 10 each outer round while the
constraint stays large (NOTEARS, DAGMA, GraN-DAG); without the cap (NOTEARS' ``rho_max =
1e16``) it passes float32's largest value, Python still holds it, and the op that takes it
(``0.5 * rho * h * h``) is +inf. The literal's hint speaks of a constant written for float32
under autocast, the precursors' of a learning rate: the fix is the schedule that grew the number,
so the hint names the attribute (of the loss, or of the origin's module) and its cap.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .domains import g
from .load import Step
from .loss_started import dotted


def number_attributes(step: Step, module: str | None, built: bool = False) -> dict[str, Any]:
    """The origin's plain number attributes as the step closed: the loss's (a loss module's
    config) or those the loop changed on the recorded module; with ``built``, also the
    module's attributes as they were at attach, which the loop never changed (a time
    constant or temperature built as 0). The loss's own plain attributes are those it began
    the step with, where the bundle holds them (a running mean its call then updated)."""
    if module == "<loss>":
        return {**((step.meta.get("loss") or {}).get("config") or {}), **loss_began(step)}
    info = next((m for m in step.meta.get("modules") or () if m.get("name") == module), {})
    return {**(info.get("attrs_at_attach") or {} if built else {}), **(info.get("attrs") or {})}


def when_read(step: Step, module: str | None, k: str) -> str:
    """When :func:`number_attributes`'s ``k`` of ``module`` held its value: "as the step
    began" for the loss's own attribute the recorder read then, else "as the step closed"."""
    return "as the step began" if module == "<loss>" and k in loss_began(step) \
        else "as the step closed"


def loss_began(step: Step) -> dict[str, Any]:
    """The loss's own plain attributes as the step began, as the bundle holds them, dotted
    (``mean``, ``stats.mean``: ``replay.loss_started``)."""
    started = (step.meta.get("loss") or {}).get("started")
    return {dotted(n, k): v for n, attrs in started.items() if isinstance(attrs, dict)
            for k, v in attrs.items()} if isinstance(started, dict) else {}


def grown_number_hint(report: dict[str, Any], step: Step) -> None:
    """Lead an overflow's hint with the origin's number attribute beyond its type's range."""
    o = report.get("origin") or {}
    dtype = getattr(torch, str(o.get("dtype")), None)
    if report.get("cause") != "overflow" or not isinstance(dtype, torch.dtype) \
            or not dtype.is_floating_point:
        return
    top = torch.finfo(dtype).max
    big = [(k, v) for k, v in number_attributes(step, o.get("module")).items()
           if type(v) is float and math.isfinite(v) and abs(v) > top]
    if not big:
        return
    k, v = max(big, key=lambda kv: abs(kv[1]))
    owner = "the loss" if o["module"] == "<loss>" else o["module"] or "the model"
    report["hint"] = (
        f"{owner}'s attribute {k} is {g(v)} as the step closed, beyond {o['dtype']}'s largest "
        f"value {g(top)}: Python holds it, but {o.get('op')} computes with it in {o['dtype']}, "
        f"so it is inf there. The loop's code grew {k} past the type's range (a penalty weight "
        "multiplied each outer round with no cap, as an augmented Lagrangian's rho without "
        f"rho_max; a schedule run past its end): cap it well below {g(top)} (rho = min(rho * "
        "10, rho_max), rho_max = 1e16) or stop the schedule there, rather than change the "
        "learning rate or the op's type")
