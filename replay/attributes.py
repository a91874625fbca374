"""Plain attributes (int, float, bool) the loop had changed on the run's modules, set again on
the rebuilt model: the factory builds them as they started (a temperature the loop annealed to
0, a scheduled dropout ``p``), so a re-run with the factory's values computes another step (an
event NOT reproduced, or blamed on the factory).

Only an attribute the rebuilt module has, of the same type, is set (a bundle never adds one
nor changes a type); the values are those the step closed with (see
``recorder.attributes``)."""

from __future__ import annotations

from typing import Any

from torch import nn

from recorder.attributes import PLAIN

_SHOWN = 6  # restored attributes named in the note


def restore_attributes(meta: dict[str, Any], model: nn.Module) -> list[str]:
    """Set the recorded plain attributes that differ on ``model``; one line per attribute
    (``name.attr = recorded (the factory built value)``)."""
    modules = dict(model.named_modules())
    restored = []
    for info in meta.get("modules") or ():
        attrs, m = info.get("attrs"), modules.get(info.get("name"))
        if not isinstance(attrs, dict) or m is None:
            continue
        for k, v in attrs.items():
            built = vars(m).get(k)
            if type(v) in PLAIN and type(built) is type(v) and built != v \
                    and k != "training":  # (the modes are set from the modules' own entries)
                setattr(m, k, v)
                restored.append(f"{info['name'] or '<root>'}.{k} = {v!r} (the factory built "
                                f"{built!r})")
    return restored


def built_otherwise(meta: dict[str, Any], model: nn.Module) -> list[str]:
    """The plain attributes the factory builds otherwise than the run had them when the
    recorder attached (set before it: a data-dependent initialisation pass's ``initialized``
    flag), which are not set again (the factory's difference, for the fidelity check to
    explain): ``name.attr = built (the run had value)``. Read before any re-run."""
    modules = dict(model.named_modules())
    out = []
    for info in meta.get("modules") or ():
        at, m = info.get("attrs_at_attach"), modules.get(info.get("name"))
        if not isinstance(at, dict) or m is None:
            continue
        later = info.get("attrs") if isinstance(info.get("attrs"), dict) else {}
        for k, v in at.items():
            built = vars(m).get(k)
            if k not in later and type(v) in PLAIN and type(built) is type(v) and built != v:
                out.append(f"{info['name'] or '<root>'}.{k} = {built!r} (the run had {v!r})")
    return out


def restored_note(restored: list[str]) -> str:
    more = f" and {len(restored) - _SHOWN} more" if len(restored) > _SHOWN else ""
    return ("the run had set attributes of the model to other values than the factory builds; "
            "the re-run uses the recorded ones: " + ", ".join(restored[:_SHOWN]) + more)
