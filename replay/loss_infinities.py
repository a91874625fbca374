"""The loss's other arguments holding +-inf, beside the one an input event names.

The recorder names the first loss argument holding an infinity. When several do (GRPO's
``old_logps`` and ``ref_logps``, and the policy's own log-probabilities, all ``-inf`` where a
padding label is a token the policy's logits forbid with ``-inf``), the op that made NaN may
take another of them: the hint then said the loss made NaN "of" the named one at a line that
never reads it. Naming every argument holding one says where the infinities come from.
"""

from __future__ import annotations

from typing import Any

import torch

from recorder.capture import tensor_leaves
from recorder.finite import finite

from .loss_arg_name import with_param_name

__all__ = ["LossCall", "others_text"]


class LossCall:
    """An ``accept`` for :func:`replay.masked_targets.watched_loss_rerun` that keeps the
    arguments the loss is re-run with."""

    def __init__(self):
        self.args: tuple = ()
        self.kwargs: dict[str, Any] = {}

    def __call__(self, args, kwargs) -> bool:
        self.args, self.kwargs = tuple(args), dict(kwargs)
        return True

    def infinite(self, loss_fn) -> list[str]:
        """The readable names (``loss_args[i] (param)``, ``loss_kwargs["k"]``) of the
        top-level arguments holding a +-inf."""
        named = [(with_param_name(f"loss_args[{i}]", loss_fn), a)
                 for i, a in enumerate(self.args)]
        named += [(f'loss_kwargs["{k}"]', v) for k, v in self.kwargs.items()]
        return [name for name, a in named
                if any(t.is_floating_point() and not finite(t) for t in tensor_leaves(a)
                       if isinstance(t, torch.Tensor))]


def others_text(call: LossCall, tensor: str, loss_fn) -> str:
    """`` (as do A and B)``: the arguments other than ``tensor`` holding an infinity."""
    others = [n for n in call.infinite(loss_fn) if not _holds(n.split(" ")[0], tensor)]
    if not others:
        return ""
    return f" (as do {', '.join(others[:-1])}{' and ' if len(others) > 1 else ''}{others[-1]})"


def _holds(top: str, tensor: str) -> bool:
    """Whether ``tensor`` is the top-level argument ``top`` or an element of it."""
    return tensor == top or tensor.startswith((top + "[", top + "."))
