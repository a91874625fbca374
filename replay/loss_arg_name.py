"""The loss's own name for a positional argument the bundle calls ``loss_args[i]``.

A loss called with six tensors (GRPO's ``loss(logits, ids, mask, old_logps, ref_logps,
advantages)``) had its NaN argument named ``loss_args[5]`` only, leaving the user to count the
call's arguments; the rebuilt loss's signature names it: ``loss_args[5] (advantages)``; an
``nn.Module`` loss's by its ``forward``.
"""

from __future__ import annotations

import inspect
import re

from torch import nn

__all__ = ["with_param_name"]

_POSITIONAL = re.compile(r"loss_args\[(\d+)\]")
_KINDS = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def with_param_name(tensor: str, loss_fn) -> str:
    """``tensor`` with the loss parameter it was passed as, when the loss's signature says
    (no name for one taken by ``*args``, or a loss the replay could not rebuild)."""
    m = _POSITIONAL.match(tensor)
    if m is None or not callable(loss_fn):
        return tensor
    # (an nn.Module's own signature is its __call__'s, (*args, **kwargs): its forward names
    # them, as a loss class's forward(logits, target, weight) does)
    fn = loss_fn.forward if isinstance(loss_fn, nn.Module) else loss_fn
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return tensor
    i = int(m.group(1))
    if i >= len(params) or any(p.kind not in _KINDS for p in params[:i + 1]):
        return tensor
    return f"{tensor} ({params[i].name}{tensor[m.end():]})"
