"""An exp that overflowed inside ``log(1 + exp(z))``: a softplus written by hand.

The Neural Hawkes Process writes its intensity ``s * log(1 + exp(x / s))``, the Transformer
Hawkes Process ``1 / beta * log(1 + exp(beta * x))`` (with a hard threshold at 20 that copies
of it drop): exp overflows wherever z is above 88 in float32, though the softplus is about z
there. The generic advice for an exp's overflow (subtract the row max, bound the exponent,
float64) misses that the formula has a form finite for every finite z. Only for an exp
origin: the forward re-run of ``replay.exp_overflow`` follows that exp's +inf into a log of 1
plus it (or its log1p).
"""

from __future__ import annotations

import math

import torch

from .memo import TensorSet
from .source import user_source

_LOGS = {"log", "log2", "log10"}


class ExpFollowed:
    """Marks the +inf outputs of the exp at ``at`` (op, line) for a subclass to follow;
    ``found``: the line where they reached the formula it looks for."""

    def __init__(self, at: tuple[str, str | None]):
        self.at, self.exps, self.sums = at, TensorSet(), TensorSet()
        self.found: str | None = None

    def marked(self, name: str, out: torch.Tensor) -> bool:
        """Whether this op is the exp at ``at`` (its +inf outputs then marked)."""
        if f"aten.{name}" != self.at[0] or user_source() != self.at[1]:
            return False
        if bool(torch.isposinf(out.detach()).any()):
            self.exps.add(out)
        return True


class SoftplusFollowed(ExpFollowed):
    """That exp's +inf, then ``1 +`` them; ``found``: the line of the first log given such a
    sum (or log1p given such an exp)."""

    def see(self, name: str, args, out: torch.Tensor, first: torch.Tensor) -> None:
        """One op of the re-run (``replay.exp_overflow``), until ``found``."""
        if self.marked(name, out):
            return
        if name == "add" and first in self.exps and len(args) == 2 \
                and isinstance(args[1], (int, float)) and args[1] == 1:
            # (1 only: log(exp(z) + eps), scVI's log(theta + 1e-8) of theta = exp(px_r), is a
            # log of an exp guarded at 0, no softplus, and its fix is not F.softplus)
            self.sums.add(out)
        elif name in _LOGS and first in self.sums or name == "log1p" and first in self.exps:
            self.found = user_source()


def softplus_text(hit, found: str) -> str:
    """The hint for an exp origin ``hit`` that overflowed inside ``log(1 + exp(z))`` at
    ``found`` (see :class:`SoftplusFollowed`): the stable forms of that softplus."""
    dt = hit.evidence.dtype if hit.evidence is not None else torch.float32
    top = math.log(torch.finfo(dt).max)
    return (f"{hit.op} overflowed inside log(1 + exp(z)) at {found}: a softplus "
            f"written by hand, whose exp is beyond {str(dt).removeprefix('torch.')}'s range "
            f"wherever z is above {top:.3g}, though the softplus there is about z (float64 "
            "only moves that edge): use F.softplus(z) (F.softplus(x, beta) for a softplus "
            "with a beta), which returns z above its threshold, or, with a learned beta, "
            "torch.logaddexp(torch.zeros_like(z), z), finite for every finite z (THP's own "
            "softplus caps beta * x at 20 for this)")
