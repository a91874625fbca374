"""A model whose class a notebook cell defined: the advice of the event's message.

A class defined in a notebook (or an interactive session) lives in a ``__main__`` with no file:
no import reaches it, so the ``nanreplay`` command, a fresh process, cannot rebuild the model
from a bundle recorded without ``factory=`` (unless the bundle describes torch.nn's own modules,
which it rebuilds importing nothing). The message then says what works from the notebook:
``replay.replay(path, factory=Net)``, the class passed itself.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any


def interactive_class(cls: type) -> str | None:
    """The name a notebook calls ``cls`` by, when a notebook cell or an interactive session
    defined it (``__main__`` without a file; not a function's local class); else None."""
    if cls.__module__ != "__main__" or "<locals>" in cls.__qualname__:
        return None
    main = sys.modules.get("__main__")
    return cls.__qualname__ if getattr(main, "__file__", None) is None else None


def replay_advice(msg: str, path: Path, meta: dict[str, Any], cls: type) -> str:
    """``msg`` with its ``nanreplay PATH`` advice replaced by ``replay.replay(PATH,
    factory=Net)`` where the command cannot rebuild the model: no factory given, no class the
    replay can call bare, no torch.nn description, the class defined in the notebook."""
    model = meta.get("model") or {}
    name = interactive_class(cls)
    if name is None or meta.get("factory") or model.get("default_factory") or model.get("stock"):
        return msg
    return msg.replace(
        f"run `nanreplay {path}`",
        f"run `replay.replay({str(path)!r}, factory={name})` in this notebook (the nanreplay "
        f"command cannot import {name}, a class defined here)")
