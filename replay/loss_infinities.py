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

__all__ = ["LossCall", "infinity_advice", "others_text"]


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


def infinity_advice(made: str, loss_fn) -> str:
    """What to do about a loss argument's ``made`` (``"+inf"``, ``"-inf"``) that the loss
    made NaN of: bounded by a number of its sign; ``log_target`` only for a loss that has it
    (``KLDivLoss``, or one held by the loss); and where the loop made it (a reward another network's saturated
    ``log(1 - sigmoid)`` gave: GAIL's and AIRL's discriminators)."""
    bound = "a finite floor (-1e4)" if made == "-inf" else "a finite ceiling (1e4)"
    mods = loss_fn.modules() if isinstance(loss_fn, torch.nn.Module) else [loss_fn]
    kl = (" or give the loss probabilities (log_target=False)"
          if any(hasattr(m, "log_target") for m in mods) else "")
    return (f"A {made} made on purpose (a log-probability of exactly 0, a masked class) must "
            f"not reach that op: clamp it to {bound}{kl}. One the loop computed (a reward or "
            "log-ratio from another network: log(1 - D) of a discriminator's sigmoid rounded "
            "to 1) is better made finite there, from the logit (logsigmoid(-z), the logit "
            "itself for log D - log(1 - D)); else check the data pipeline for these samples")
