"""A module whose ``forward`` was replaced on the instance (``model.forward =
types.MethodType(fn, model)``) by code other than the mixed-precision wrappers the recorder
reads on their own: a trainer that patches the model it trains (TRL's ``add_fused_lm_head``,
whose forward returns per-token log-probabilities instead of logits). A factory builds the
class's forward, so the bundle names the patch and the replay checks that the factory's model
has it (:mod:`replay.patched_forward`). Shared by both packages."""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

# wrappers that keep the forward's computation and only set its precision (accelerate's
# autocast and convert-outputs-to-fp32 wrappers, torch.autocast as a decorator)
# (a ScriptModule's compiled forward, torch._C's ScriptMethod, is its class's too)
PASS_THROUGH = {"accelerate", "torch"}


def patched_forward(m: nn.Module) -> str | None:
    """``module.qualname`` of the function ``m``'s instance ``forward`` runs in place of its
    class's (a closure's own name, ``pkg.mod.patcher.<locals>.fn``, even where
    ``functools.wraps`` copied the class forward's name onto it), None when it runs the
    class's, or only precision wrappers around it."""
    try:
        return _patched(m)
    except Exception:  # (an exotic forward object: no claim, and the event's bundle is written)
        return None


def _patched(m: nn.Module) -> str | None:
    fn: Any = vars(m).get("forward")
    if fn is None:
        return None
    # (read statically: a ScriptModule's class attribute is a descriptor that raises)
    own = getattr(inspect.getattr_static(type(m), "forward", None), "__code__", None)
    for _ in range(32):
        if fn is None:
            return None
        fn = getattr(fn, "__func__", fn)
        code = getattr(fn, "__code__", None)
        if code is not None and code is own:
            return None
        where = _module_of(fn)
        if where.split(".")[0] not in PASS_THROUGH:
            name = getattr(code, "co_qualname", None) or getattr(fn, "__qualname__", None) \
                or type(fn).__qualname__
            return f"{where}.{name}"
        fn = getattr(fn, "__wrapped__", None) or getattr(fn, "model_forward", None)
    return None


def _module_of(fn: Any) -> str:
    """The module whose code ``fn`` is: a function's globals' (not its ``__module__``, which
    ``functools.wraps`` overwrites), else its class's."""
    glob = getattr(fn, "__globals__", None)
    if isinstance(glob, dict) and isinstance(glob.get("__name__"), str):
        return glob["__name__"]
    return type(fn).__module__ or ""


def patcher(name: str) -> str | None:
    """The function that made the patch, ``pkg.mod.patcher``, where the patch is a closure
    it defined (``pkg.mod.patcher.<locals>.fn``); else None."""
    head, sep, _ = name.partition(".<locals>.")
    return head if sep else None
