"""What an exp that overflowed in the forward or the loss was part of, from one forward re-run: a
softplus written by hand, ``log(1 + exp(z))`` (``replay.softplus_overflow``), an exp of a
cumulative sum taken as is (``replay.cumsum_exp``), or a softmax written by hand,
``exp(s) / exp(s).sum(dim)`` (``replay.softmax_overflow``), or an exp of a difference whose
subtracted operand holds a mask's fill (``replay.fill_ratio``: PPO's ``exp(logp - old_logp)`` of
log-probabilities stored under another action mask), or an exp of a trained parameter
(``replay.exp_param_overflow``: Kendall's ``exp(-s)``). Each has a form finite by construction, which the
generic advice for an exp's overflow (subtract the row max, bound the exponent, float64)
misses."""

from __future__ import annotations

import torch

from .compat import TorchDispatchMode
from .cumsum_exp import CumsumFollowed, cumsum_exp_text
from .dispatch import run_op
from .exp_param_overflow import ParamExpFollowed, param_exp_text, trained_params
from .fill_ratio import FillRatioFollowed, fill_ratio_text
from .softmax_overflow import SoftmaxFollowed, softmax_text
from .softplus_overflow import SoftplusFollowed, softplus_text


class _Following(TorchDispatchMode):
    """Runs each op once and shows it to each follower that has not found its pattern yet."""

    def __init__(self, *followers):
        super().__init__()
        self.followers = followers

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = run_op(func, args, kwargs or {})
        first = args[0] if args else None
        if isinstance(out, torch.Tensor) and isinstance(first, torch.Tensor):
            name = func.overloadpacket.__name__
            for f in self.followers:
                if f.found is None:
                    f.see(name, args, out, first)
        return out


def exp_overflow_hint(runner, hint: str | None, cause: str, hit) -> str | None:
    """``hint`` for an exp origin ``hit`` that overflowed: the cumulative sum's form where the
    exp took one, else the softplus's where it was inside ``log(1 + exp(z))``, else the
    softmax's where a sum of it divided it, the mask fill's where it took a difference with
    one; ``hint`` as it is otherwise (and for any other
    origin)."""
    if cause != "overflow" or hit is None or hit.op not in ("aten.exp", "aten.exp_") \
            or hit.source is None:
        return hint
    at = (hit.op, hit.source)
    soft, sums, ratio = SoftplusFollowed(at), CumsumFollowed(at), SoftmaxFollowed(at)
    filled = FillRatioFollowed(at)
    try:
        param = ParamExpFollowed(at, trained_params(runner))
        runner.run(backward=False, instrument=False,
                   forward_ctx=lambda: _Following(soft, sums, ratio, filled, param))
    except Exception:  # (the hint as it is: this only says what the exp was given, or in)
        return hint
    if sums.found is not None:
        return cumsum_exp_text(hit, sums.found)
    if soft.found is not None:
        return softplus_text(hit, soft.found)
    if ratio.found is not None:
        return softmax_text(hint, ratio.found)
    if filled.found is not None:
        return fill_ratio_text(hit, filled.found, filled.hit)
    return param_exp_text(hit, param.hit) if param.hit is not None else hint
