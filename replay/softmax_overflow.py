"""An exp that overflowed inside ``exp(s) / exp(s).sum(dim)``: a softmax written by hand.

An InfoNCE over similarities scaled by a temperature, written ``e = exp(sim / tau);
-log(e.diagonal() / e.sum(1))`` (CEBRA-style contrastive losses, hand-written attention,
a mixture's responsibilities): exp overflows wherever a score is above 88.7 in float32 (a
cosine similarity of 1 over a temperature of 0.01 is 100), and the ratio is inf/inf, though the
softmax itself is at most 1. The generic advice for an exp's overflow (bound the exponent, float64)
misses that the formula has a form finite for every finite score. Only for an exp origin: the
forward re-run of ``replay.exp_overflow`` follows that exp's +inf through picks of its entries
(the positives' diagonal) and sums of it into a division of the two.
"""

from __future__ import annotations

import torch

from .softplus_overflow import ExpFollowed
from .source import user_source

# ops that pass an exp's entries on as they are (a view, the positives picked out of it)
_PICKS = {"diagonal", "select", "slice", "index", "gather", "narrow", "view", "reshape",
          "_unsafe_view", "alias", "squeeze", "unsqueeze", "expand", "clone", "contiguous",
          "take_along_dim", "masked_select", "index_select", "transpose", "t", "permute"}
_SUMS = {"sum", "cumsum"}  # (a cumsum: a causal normaliser's running sum)
_DIVISIONS = {"div", "div_"}


class SoftmaxFollowed(ExpFollowed):
    """That exp's +inf, what picks entries of them and what sums them; ``found``: the line of
    the first division of the one by the other."""

    def see(self, name: str, args, out: torch.Tensor, first: torch.Tensor) -> None:
        """One op of the re-run (``replay.exp_overflow``), until ``found``."""
        if self.marked(name, out):
            return
        if name in _PICKS and first in self.exps:
            self.exps.add(out)
        elif name in _SUMS and first in self.exps:
            self.sums.add(out)
        elif name in _DIVISIONS and first in self.exps and len(args) == 2 \
                and isinstance(args[1], torch.Tensor) and args[1] in self.sums:
            self.found = user_source()


def softmax_text(hint: str | None, found: str) -> str:
    """``hint`` (the exp's overflow) for an exp origin that overflowed inside
    ``exp(s) / exp(s).sum(dim)`` divided at ``found`` (see :class:`SoftmaxFollowed`), with the
    stable forms of that softmax."""
    return (f"{hint or 'the exp overflowed'}. That exp is divided by a sum of its own entries "
            f"at {found}: a softmax written by hand, exp(s) / exp(s).sum(dim), at most 1 "
            "whatever the scores (a similarity over a small temperature, importance "
            "log-weights cooled): torch.softmax(s, dim), or log_softmax(s, dim) where a log of "
            "it follows (F.cross_entropy(s, target) for an InfoNCE's -log of the positive's "
            "share), subtract the row max before exp and are finite for every finite score "
            "(an iterated normalisation, Sinkhorn's, runs in log space with logsumexp)")
