"""Plain attributes (int, float, bool) the loop had changed on the run's modules, set again on
the rebuilt model: the factory builds them as they started (a temperature the loop annealed to
0, a scheduled dropout ``p``), so a re-run with the factory's values computes another step (an
event NOT reproduced, or blamed on the factory).

Only an attribute the rebuilt module has, of the same type, is set (a bundle never adds one
nor changes a type); the values are those the step closed with (see
``recorder.attributes``)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from recorder.attributes import PLAIN, class_defaults, trained_tensors

from .class_kept import set_where_kept

_SHOWN = 6  # restored attributes named in the note
SPELT = ("nan", "inf", "-inf")  # the bundle's non-finite floats (recorder.bundle.jsonable)


def restore_attributes(meta: dict[str, Any], model: nn.Module) -> list[str]:
    """Set the recorded plain attributes that differ on ``model``; one line per attribute
    (``name.attr = recorded (the factory built value)``)."""
    restored = []
    for name, m, k, v, built in _differing(meta, model, "attrs"):
        if k != "training":  # (the modes are set from the modules' own entries)
            set_where_kept(m, k, v)
            bad = type(v) is float and not math.isfinite(v)  # (a schedule's 0/0: DANN's lambda)
            restored.append(f"{name}.{k} = {v!r} (the factory built {built!r}"
                            + ("; non-finite: the loop's code that set it, a schedule, made "
                               "it so, and the step computed with it)" if bad else ")"))
    return restored


def set_step_attributes(meta: dict[str, Any], model: nn.Module, attrs: dict | None) -> None:
    """The plain attributes as one step of the rewind window began: ``attrs``, a record's
    differences from attach by module (None in an older bundle: the model keeps the event
    step's), where the loop had set them then, and the value at attach where it set them
    only later (by the event step; the rest are the factory's, as for the step itself)."""
    if attrs is None:
        return
    modules = dict(model.named_modules())
    for info in meta.get("modules") or ():
        m, at_attach = modules.get(info.get("name")), info.get("attrs_at_attach")
        later, now = info.get("attrs"), attrs.get(info.get("name")) or {}
        if m is None or not isinstance(at_attach, dict) or not (later or now):
            continue
        for k in {*(later or ()), *now}:
            v, built = now.get(k, at_attach.get(k)), built_value(m, k)
            v = as_built(v, built)
            if k != "training" and type(v) in PLAIN and type(built) is type(v):
                set_where_kept(m, k, v)


def event_attributes(meta: dict[str, Any]) -> dict[str, dict]:
    """The event step's attributes by module, as :func:`set_step_attributes` takes them."""
    return {info.get("name"): info.get("attrs") or {} for info in meta.get("modules") or ()}


def restore_trained(meta: dict[str, Any], tensors: dict[str, torch.Tensor], model: nn.Module
                    ) -> list[str]:
    """Set the bundle's trained tensor attributes (``recorder.attributes.trained_tensors``:
    DARTS's alphas kept outside the parameters) on the modules that have them, of the same
    shape, as leaves requiring grad on the module's device; the qualified names set."""
    modules = dict(model.named_modules())
    done = []
    for info in meta.get("modules") or ():
        m = modules.get(info.get("name"))
        if m is None or not isinstance(info.get("trained"), list):
            continue
        built = trained_tensors(m)
        for k in info["trained"]:
            name = f"{info['name']}.{k}" if info["name"] else k
            v, have = tensors.get(f"trained/{name}"), built.get(k)
            if v is None or have is None or v.shape != have.shape:
                continue
            setattr(m, k, v.detach().to(have.device, have.dtype).clone().requires_grad_())
            done.append(name)
    return done


def built_otherwise(meta: dict[str, Any], model: nn.Module) -> list[str]:
    """The plain attributes the factory builds otherwise than the run had them when the
    recorder attached (set before it: a data-dependent initialisation pass's ``initialized``
    flag), which are not set again (the factory's difference, for the fidelity check to
    explain): ``name.attr = built (the run had value)``. Read before any re-run."""
    later = {info.get("name"): info.get("attrs") for info in meta.get("modules") or ()
             if isinstance(info.get("attrs"), dict)}
    return [f"{name}.{k} = {built!r} (the run had {v!r})"
            for name, _, k, v, built in _differing(meta, model, "attrs_at_attach")
            if k not in later.get("" if name == "<root>" else name, {})]


def _differing(meta: dict[str, Any], model: nn.Module, key: str):
    """``(name, module, attr, recorded, built)`` for each recorded plain attribute (under
    ``key`` of the bundle's module entries) that ``model``'s module has, of the same type, with
    another value. A bundle never adds an attribute nor changes a type."""
    modules = dict(model.named_modules())
    for info in meta.get("modules") or ():
        attrs, m = info.get(key), modules.get(info.get("name"))
        if not isinstance(attrs, dict) or m is None:
            continue
        for k, v in attrs.items():
            built = built_value(m, k)
            v = as_built(v, built)
            if type(v) in PLAIN and type(built) is type(v) and built != v \
                    and not (built != built and v != v):  # (NaN both: the same)
                yield info["name"] or "<root>", m, k, v, built


def built_value(m: nn.Module, k: str):
    """``m``'s attribute ``k`` as the factory built it: its own, else its class's default
    (``calls = 0``, which the run's ``self.calls += 1`` had set on the instance)."""
    return vars(m)[k] if k in vars(m) else class_defaults(m).get(k)


def as_built(v, built):
    """``v`` as a float where the factory builds a float: a non-finite one the bundle spells
    ('nan', recorder.bundle.jsonable), or an int the loop set it to (a temperature from a
    schedule of ints, ``beta = betas[step]``: the same number); the type stays the factory's."""
    if type(built) is float and (v in SPELT or (type(v) is int and abs(v) < 2 ** 53)):
        return float(v)
    return v


def restored_note(restored: list[str]) -> str:
    more = f" and {len(restored) - _SHOWN} more" if len(restored) > _SHOWN else ""
    return ("the run had set attributes of the model to other values than the factory builds; "
            "the re-run uses the recorded ones: " + ", ".join(restored[:_SHOWN]) + more)
