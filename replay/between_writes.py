"""Weights the loop wrote between the last update and the event step's forward: a head
re-initialised mid-run (``reset_parameters()`` and an init of its own), a checkpoint loaded,
an in-place edit. The ring's row of the event step holds each parameter's norm as the update
before left it (taken in ``step()``'s post-hook); the bundle holds the weights the event step's
forward used. A norm that differs says the loop wrote them in between: the rewind window,
which re-runs the recorded batches with the optimizer alone, does not redo that write (its
steps before the event's are checked by ``replay.departure``), and an overflow of such a
weight's scale is the write's, not the data's nor a type's limit to widen."""

from __future__ import annotations

import math
from typing import Any

from .departure import after_updates
from .load import Step

__all__ = ["written_note", "written_weights", "written_weights_hint"]

_APART = 1e-3  # as replay.departure: an update's reordered sums move a norm by far less
_REACH = 1e3  # the written weight's largest value times this reaches the op's scale
_GREW = 10.0  # and the write grew its norm this much: a clamp_ or a restore is no such write


def written_weights(step: Step) -> list[tuple[str, float, float, float]]:
    """``(name, norm the last update left, norm the event's forward used, its abs max)`` of
    each parameter of the recorded optimizer the loop wrote since that update; [] when the bundle cannot tell (an
    optimizer or weights event, whose weights are not the forward's; sharded weights; SAM's
    ascent, which moves them between a step's forwards)."""
    ev = step.event
    if ev.get("phase") not in ("forward", "backward") or ev.get("step") is None \
            or _moved(step):
        return []
    left = after_updates(step).get(int(ev["step"]) - 1) or {}
    # (the optimizer's own: a frozen momentum encoder the forward writes is held as the step
    # left it, replay.param_writes')
    held = {n for g in (step.meta.get("optimizer") or {}).get("param_groups") or []
            for n in g.get("params") or [] if isinstance(n, str)}
    out = []
    for name, was in left.items():
        t = step.tensors.get(f"weights/{name}") if name in held else None
        if t is None or not t.is_floating_point():
            continue
        a = t.detach().double().abs()
        now = float(a.norm())
        if math.isfinite(now) and not math.isclose(now, was, rel_tol=_APART, abs_tol=1e-6):
            out.append((name, was, now, float(a.max())))
    return out


def _moved(step: Step) -> bool:
    return any(mb.get("weights_moved") for mb in step.micro_batches or [])


def _listed(found: list[tuple[str, float, float, float]]) -> str:
    shown = ", ".join(f"{n} (norm {was:.3g} -> {now:.3g})" for n, was, now, _ in found[:3])
    return shown + (f" and {len(found) - 3} more" if len(found) > 3 else "")


def written_note(step: Step) -> str | None:
    """Why a window does not give the event back when the loop wrote weights since the last
    update, or None."""
    if not (found := written_weights(step)):
        return None
    at = step.event["step"]
    return (f"the loop wrote {_listed(found)} between step {at - 1}'s update and step {at}'s "
            "forward (a re-initialisation: reset_parameters() and an init; a load_state_dict; "
            "an in-place edit), which the window, re-running the batches with the optimizer "
            "alone, does not redo: its step-" + str(at) + " forward ran on the weights step "
            f"{at - 1}'s update left, the recorded one on the written ones")


def written_weights_hint(report: dict[str, Any], step: Step) -> None:
    """Replace a forward overflow's advice when its scale is that of a weight the loop wrote
    since the last update (see the module)."""
    o = report.get("origin") or {}
    span = o.get("input_range") or []
    if report.get("cause") != "overflow" or o.get("phase") != "forward" or len(span) != 2:
        return
    top = max(abs(float(v)) for v in span)
    found = [f for f in written_weights(step) if f[3] * _REACH >= top and f[2] >= _GREW * f[1]]
    if not math.isfinite(top) or not found:
        return
    name, was, now, big = max(found, key=lambda f: f[3])
    at = step.event["step"]
    said = (f"{name} is not what step {at - 1}'s update left (norm {was:.3g}) but what the loop "
            f"wrote into it before step {at}'s forward (norm {now:.3g}, values up to {big:.3g}), "
            "and the overflow is of that scale")
    if _own_advice(report, o):  # (a half type's limit, a parametrization's range: kept)
        report["hint"] = f"{said}; check that write. {report.get('hint') or ''}".rstrip()
        return
    report["hint"] = (
        f"{said}: not the data's, nor a type's limit to widen. "
        "Check that write: a re-initialisation (reset_parameters() followed by an init whose "
        "std or bound is not 1/sqrt(fan_in)'s scale), a load_state_dict of another run's or "
        "a corrupted checkpoint, an in-place edit; the weights it writes should be of the "
        "scale the layer's own reset_parameters() gives")


def _own_advice(report: dict[str, Any], o: dict[str, Any]) -> bool:
    """The hint already says what the op's own limit is: a half type's (float16 autocast,
    where float32 holds the written scale) or a parametrization's, whose range to keep."""
    dtypes = {o.get("dtype"), *(c.get("dtype") for c in o.get("chain") or ())}
    return bool(dtypes & {"float16", "bfloat16"}) or "parametrization" in (report.get("hint") or "")
