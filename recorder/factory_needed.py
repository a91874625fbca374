"""A model recorded without ``factory=`` that the replay cannot build alone: its class takes
constructor arguments the bundle does not hold (``Net(hidden)`` keeping ``hidden`` nowhere),
it is no torch.nn model the bundle describes, and no notebook defined it (``notebook``); an
``input`` or ``weights`` event, which the replay shows without a model, aside. The event's
message gave the bare ``nanreplay PATH``, which then re-ran nothing ('factory not imported');
it now gives the command with ``--factory``, and says why.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .factory_home import needs_model
from .notebook import interactive_class


def factory_advice(msg: str, path: Path, meta: dict[str, Any], cls: type) -> str:
    """``msg`` with its ``nanreplay PATH`` advice given ``--factory MOD:FN`` where nothing in
    the bundle rebuilds the model (see the module's doc)."""
    model = meta.get("model") or {}
    if not needs_model(meta) or meta.get("factory") or model.get("default_factory") or model.get("stock") \
            or (model.get("init") or {}).get("args") or interactive_class(cls) is not None:
        return msg
    return msg.replace(
        f"run `nanreplay {path}`",
        f"run `nanreplay {path} --factory MOD:FN`, MOD:FN a function returning the model "
        f"({cls.__qualname__}'s constructor takes arguments the bundle does not hold, so the "
        "replay cannot build it alone; FlightRecorder(..., factory=\"MOD:FN\") records it),")
