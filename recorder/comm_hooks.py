"""The communication hooks registered on the DistributedDataParallel the recorder wraps
(``ddp.register_comm_hook(state, hook)``: ``fp16_compress_hook``, PowerSGD, the user's own),
described in the bundle at an event (never per step). The gradients DDP hands the optimizer are
the hook's output, which the single-process replay, running no all-reduce, cannot re-make: a
float16 hook's cast or sum can overflow gradients every rank computed finite."""

from __future__ import annotations

import weakref
from typing import Any

from .compat import ddp_comm_hooks
from .user_hooks import describe

_NUMBERS = (bool, int, float, str)


def _state(state: object) -> dict[str, Any] | None:
    """The hook state's class and its plain number settings (PowerSGD's rank, start step)."""
    if state is None:
        return None
    fields = getattr(state, "__slots__", None) or list(getattr(state, "__dict__", {}))
    out: dict[str, Any] = {"class": type(state).__qualname__}
    for name in fields:
        try:  # (a user's state object: a property may raise; never at the bundle's cost)
            value = getattr(state, name, None)
        except Exception:
            continue
        if not name.startswith("_") and isinstance(value, _NUMBERS):
            out[name] = value
    return out


def comm_hooks_meta(ddp: weakref.ref | None) -> dict[str, Any] | None:
    """``{"comm_hooks": [{"name", "module", "state"}, ...]}`` for the DDP ``ddp`` refers to
    (a built-in C++ hook by its name alone), or None without a DDP."""
    model = ddp() if ddp is not None else None
    if model is None:
        return None
    return {"comm_hooks": [_describe(hook, state) for hook, state in ddp_comm_hooks(model)]}


def _describe(hook, state) -> dict[str, Any]:
    if isinstance(hook, str):  # (a built-in C++ hook: its name alone)
        return {"name": hook, "module": None, "state": None}
    module = getattr(getattr(hook, "func", hook), "__module__", None)
    own = describe(hook) if not (module or "").startswith("torch.") else {}  # (its line)
    return {"name": getattr(hook, "__qualname__", type(hook).__qualname__), **own,
            "module": module, "state": _state(state)}
