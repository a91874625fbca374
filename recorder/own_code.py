"""A forward event whose maker is a call's own code, its output finite: an adaptive ODE solver
whose NaN step size its ``torch.where`` keeps out of the state it returns, though its
children's calls took it in. The event names that call, the kind of value it made and the
child that first took it in, not the call's output (finite, no kind). Slow path only, as
:mod:`recorder.events`."""

from __future__ import annotations

from typing import Any

from .finite import flags_kind


def taken_in_by(calls: list[dict[str, Any]], d: dict[str, Any],
                names: list[str]) -> tuple[dict[str, Any], int] | None:
    """The first call inside ``d`` (completed since its module's previous call in its
    micro-batch) whose inputs were non-finite, of the outermost module that has one (the
    child ``d`` handed the value to, not its first layer), and its number among its module's
    calls there; None when ``d``'s outputs were non-finite or no such call is found."""
    if not d["outputs_finite"]:
        return None
    mb, own = d["micro_batch"], names[d["module"]]
    same = [c for c in calls if c["micro_batch"] == mb]
    prev = max((c["order"] for c in same if c["module"] == d["module"]
                and c["order"] < d["order"]), default=-1)
    inside = sorted((c for c in same if prev < c["order"] < d["order"]
                     and not c["inputs_finite"]
                     and (own == "" or names[c["module"]].startswith(own + "."))),
                    key=lambda c: (names[c["module"]].count("."), c["order"]))
    if not inside:
        return None
    first = inside[0]
    return first, sum(1 for c in same if c["module"] == first["module"]
                      and c["order"] < first["order"])


def own_code_detail(event: Any, calls: list[dict[str, Any]], d: dict[str, Any],
                    names: list[str]) -> None:
    """Give ``event`` (at call ``d``) the kind and detail of a value ``d``'s own code made
    while its output stayed finite."""
    found = taken_in_by(calls, d, names)
    if found is None:
        return
    child, call = found
    event.kind = flags_kind(child["nan"], child["posinf"], child["neginf"]) or event.kind
    event.detail = (f"{event.kind} made by the own code of {event.module or '<root>'} "
                    f"({event.module_type}), call {event.call}, whose output is finite; "
                    f"first taken in by {names[child['module']] or '<root>'} (call {call})")
