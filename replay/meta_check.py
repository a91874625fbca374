"""Is a bundle's metadata what the replay, ``--info`` and ``--strip`` read: each key they rely on
of the JSON type they expect. Apart from the replay's loading (no torch) so that ``--info`` and
``--strip`` start fast."""

from __future__ import annotations

import os
from typing import Any

from recorder.errors import BundleError

# The metadata keys the replay and --info rely on, with their JSON types (absent keys other than
# "event" are fine: the recorder leaves out what a run did not have).
_DICT, _LIST, _STR, _INT, _NULL = dict, list, str, int, type(None)
_META_TYPES: dict[str, tuple[type, ...]] = {
    "event": (_DICT,), "factory": (_STR, _NULL), "state": (_STR,), "params": (_LIST,),
    "buffers": (_LIST,), "modules": (_LIST,), "micro_batches": (_LIST,), "model": (_DICT,),
    "optimizer": (_DICT, _NULL), "loss": (_DICT, _NULL), "ring": (_DICT,), "env": (_DICT,),
    "stripped": (_LIST,), "allow_inf": (_LIST,), "allow_nan": (_LIST,), "rng": (_DICT,), "strict_inf": (bool,),
    "factory_kwargs": (_DICT, _NULL),
}
_EVENT_TYPES: dict[str, tuple[type, ...]] = {
    "step": (_INT,), "phase": (_STR, _NULL), "module": (_STR, _NULL), "samples": (_LIST,),
    "params": (_LIST,),
}
_JSON_NAMES = {dict: "an object", list: "a list", str: "a string", int: "an integer",
               float: "a number", bool: "a boolean", type(None): "null"}


def check_meta(meta: dict[str, Any], path: str | os.PathLike) -> None:
    """Raise :class:`BundleError` (one line) when the metadata lacks the event or holds a key
    of the wrong JSON type, before anything reads it (or imports a factory because of it)."""
    def bad(what: str) -> BundleError:
        return BundleError(f"{path}: metadata {what}; the file is corrupted or was not written "
                           "by the recorder")

    def check(where: str, value: Any, types: tuple[type, ...]) -> None:
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            want = " or ".join(_JSON_NAMES[t] for t in types)
            kind = dict if isinstance(value, dict) else type(value)  # (the reader's Metadata)
            raise bad(f"{where} is {_JSON_NAMES.get(kind, kind.__name__)}, not {want}")

    if "event" not in meta:
        raise bad("lacks 'event'")
    for key, types in _META_TYPES.items():
        if key in meta:
            check(repr(key), meta[key], types)
    ev = meta["event"]
    if "step" not in ev:
        raise bad("'event' lacks 'step'")
    for key, types in _EVENT_TYPES.items():
        if key in ev:
            check(f"'event.{key}'", ev[key], types)
    for key in ("params", "buffers", "stripped", "allow_inf", "allow_nan"):
        for v in meta.get(key, []):
            check(f"{key!r} entry", v, (_STR,))
    for m in meta.get("modules", []):
        check("'modules' entry", m, (_DICT,))
        check("'modules' entry name", m.get("name"), (_STR,))
    for mb in meta.get("micro_batches", []):
        check("'micro_batches' entry", mb, (_DICT,))
