"""The loss's own name for a positional argument the bundle calls ``loss_args[i]``; the
model's ``forward``'s for a model input it calls ``args[i]``.

A loss called with six tensors (GRPO's ``loss(logits, ids, mask, old_logps, ref_logps,
advantages)``) had its NaN argument named ``loss_args[5]`` only, leaving the user to count the
call's arguments; the rebuilt loss's signature names it: ``loss_args[5] (advantages)``; an
``nn.Module`` loss's by its ``forward``. A model called with positional tensors
(``model(ids, feats, mask)``, as a custom Accelerate loop calls it) had a NaN input named
``args[1]`` only; its ``forward`` names it ``feats``.
"""

from __future__ import annotations

import inspect
import re

from torch import nn

__all__ = ["forward_param_name", "with_param_name"]

_POSITIONAL = re.compile(r"loss_args\[(\d+)\]")
_MODEL_POSITIONAL = re.compile(r"args\[(\d+)\]")
_KINDS = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def with_param_name(tensor: str, loss_fn) -> str:
    """``tensor`` with the loss parameter it was passed as, when the loss's signature says
    (no name for one taken by ``*args``, or a loss the replay could not rebuild)."""
    m = _POSITIONAL.match(tensor)
    name = _param_at(loss_fn, int(m.group(1))) if m else None
    return f"{tensor} ({name}{tensor[m.end():]})" if name else tensor


def forward_param_name(tensor: str | None, model) -> str | None:
    """The name ``model``'s ``forward`` gives the positional input ``args[i]`` (exactly
    that: no name for a part of one, ``args[0]['x']``); None where it takes ``*args`` or the
    model was not rebuilt."""
    m = _MODEL_POSITIONAL.fullmatch(tensor or "")
    return _param_at(model, int(m.group(1))) if m else None


def _param_at(fn, i: int) -> str | None:
    """The name of positional parameter ``i`` of ``fn`` (an ``nn.Module``'s ``forward``)."""
    if not callable(fn):
        return None
    # (an nn.Module's own signature is its __call__'s, (*args, **kwargs): its forward names
    # them, as a loss class's forward(logits, target, weight) does)
    fn = fn.forward if isinstance(fn, nn.Module) else fn
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if i >= len(params) or any(p.kind not in _KINDS for p in params[:i + 1]):
        return None
    return params[i].name
