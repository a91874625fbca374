"""An exp that overflowed on a difference whose subtracted operand holds a mask's fill value.

PPO's importance ratio ``exp(logp - old_logp)`` (MAPPO, IPPO, V-trace's ``exp(target_logp -
behaviour_logp)``) takes log-probabilities stored at the rollout. A policy that fills the logits
of unavailable actions with a large finite negative number (MAPPO's ``-1e10``) gives an action
its mask excluded a log-probability of about that number; when the stored one was computed
under another mask than the update's (a buffer's available actions stored one step off, an
exploration drawing over every action), ``logp - old_logp`` is about ``1e10`` and the ratio is
+inf on those samples, though every value is finite and the learning rate is not at fault. The
generic advice for an exp's overflow (subtract the row max, clamp the exponent) would hide
that the stored log-probabilities are of actions the mask forbade. Followed in one forward re-run
by ``replay.exp_overflow``: a ``sub`` whose second operand holds, where the exp overflowed, a
value of a fill's magnitude among entries of an ordinary one.
"""

from __future__ import annotations

import torch

from .cause_text import BEYOND_FLOAT64
from .memo import TensorMemo
from .softplus_overflow import ExpFollowed
from .source import user_source

FILL = 1e8  # a magnitude no log-probability or score of the data reaches, a mask's fill does
ORDINARY = 1e4  # what the operand's other entries stay within


class FillRatioFollowed(ExpFollowed):
    """``found``: the line of the ``sub`` whose output the exp at ``at`` overflowed on, with
    ``hit``: (fill value, count of the entries that overflowed, the other entries' lowest and
    highest)."""

    def __init__(self, at):
        super().__init__(at)
        self.subs = TensorMemo()
        self.hit: tuple | None = None

    def see(self, name: str, args, out: torch.Tensor, first: torch.Tensor) -> None:
        """One op of the re-run (``replay.exp_overflow``), until ``found``."""
        if self.marked(name, out):
            seen = self.subs.get(first)
            if seen is not None and out in self.exps:
                over = torch.isposinf(out.detach()).expand_as(seen[1])
                filled = seen[1][over]
                if filled.numel() and bool((filled.abs() >= FILL).all()):
                    self.found, self.hit = seen[0], (seen[2][0], filled.numel(), *seen[2][2:])
            return
        if name == "sub" and len(args) >= 2 and isinstance(args[1], torch.Tensor) \
                and args[1].is_floating_point() and args[1].numel():
            b = args[1].detach()
            big = b.isfinite() & (b <= -FILL)
            rest = b[b.isfinite() & ~big]
            if bool(big.any()) and rest.numel() and bool((rest.abs() < ORDINARY).all()):
                b_full = b.expand(out.shape) if b.shape != out.shape else b
                fill = float(b[big].max())
                self.subs.put(out, (user_source(), b_full, (
                    fill, int(big.sum()), float(rest.min()), float(rest.max()))))


def fill_ratio_text(hit, found: str, seen: tuple) -> str:
    """The hint for an exp origin ``hit`` that overflowed on ``a - b`` at ``found`` whose ``b``
    holds a mask's fill (see :class:`FillRatioFollowed`)."""
    fill, count, lo, hi = seen
    return (f"{hit.op} overflowed on the difference at {found}, whose subtracted operand holds "
            f"{fill:.3g} at the {count} entries that overflowed (its others "
            f"between {lo:.3g} and {hi:.3g}): no log-probability of a real choice is that low, "
            "but a fill value is: a mask's (logits of unavailable actions filled with -1e10 "
            "before the softmax) or a sentinel stored where there is no action or token "
            "(padding). In an importance ratio exp(logp - old_logp), the stored "
            "log-probabilities of those entries are such fills: computed under another mask "
            "than this update's (available actions stored one step off, or for the next "
            "state), of an action drawn outside the mask (exploration over every action), or "
            "padding the loss masks out only after the exp. Store the mask the action was "
            "taken under and use it in both passes, and store 0 rather than a fill where the "
            f"loss leaves entries out. e^{-fill:.3g} is too large for float32{BEYOND_FLOAT64}, "
            "and clamping the exponent or a lower learning rate would only hide it")
