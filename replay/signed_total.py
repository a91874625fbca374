"""A division by a total over the batch of values of both signs, which cancelled to 0.

A jet tagger's loss weighted by the event generator's weights, normalised by their sum,
``(w * ce).sum() / w.sum()``: an NLO generator (MC@NLO) writes weights of +1 and -1, and a
batch with as many of each sums to exactly 0. The generic advice for a 0-d total of 0
(``count.clamp_min(1)``, an eps on a statistic) is for counts and sums of values >= 0; a
signed sum is no count: it is near 0 in many batches and below 0 in some (which flips the
loss's sign), so clamping it or adding an eps leaves a loss scaled by a near-0 or negative
number. :class:`SignedTotals` watches the ops (fed by :class:`~replay.lineage.Lineage`) for a
sum or mean of data (nothing the model learns) holding both signs, carried through copies,
views and sign-keeping products, and the first division that went non-finite at its 0;
:func:`with_signed_total` then says to normalise by what cannot cancel.
"""

from __future__ import annotations

import torch

from .memo import TensorMarks

_TOTALS = {"sum", "mean", "nansum", "nanmean"}
_SAME = {"_to_copy", "to", "clone", "alias", "view", "reshape", "_unsafe_view", "contiguous",
         "detach", "squeeze", "unsqueeze", "expand"}
_POLES = {"div": 1, "reciprocal": 0}


class SignedTotals:
    def __init__(self, learned=lambda t: t.requires_grad):
        self._made = TensorMarks()  # a signed total: the op that made it
        self._learned = learned
        self.found: str | None = None  # aten.NAME of the division at such a total's 0

    def track(self, name: str, args, out) -> None:
        name = name.split(".")[0]
        if self.found is not None or not args or not isinstance(out, torch.Tensor) \
                or not isinstance(first := args[0], torch.Tensor):
            return
        if name in _TOTALS and out.dim() == 0 and first.dtype != torch.bool \
                and not first.is_complex() \
                and first.numel() > 1 and not self._learned(first) \
                and bool((first < 0).any()) and bool((first > 0).any()):
            self._made.put(out, name)
            return
        if name in _SAME and (made := self._made.get(first)) is not None:
            self._made.put(out, made)
            return
        at = _POLES.get(name.rstrip("_"))
        if at is None or len(args) <= at or not isinstance(x := args[at], torch.Tensor) \
                or self._made.get(x) is None:
            return
        try:
            if bool(((x == 0) & ~torch.isfinite(out)).any()):
                self.found = f"aten.{name}"
        except RuntimeError:  # (shapes that do not broadcast to the output)
            return


def with_signed_total(hint: str | None, cause: str | None, hit,
                      watch: SignedTotals | None) -> str | None:
    """``hint``, for a division by a signed total over the batch that cancelled to 0."""
    if hint is None or watch is None or watch.found is None or cause != "invalid" \
            or hit is None or watch.found != hit.op:
        return hint
    return (f"{hit.op} by 0 (x/0): the divisor is a sum or mean over the batch of values of "
            "both signs (signed weights: an NLO event generator's negative weights, "
            "reweighting factors below 0), which cancelled to exactly 0 in this step: no "
            "sample is to blame, and a signed total is no count: it is near 0 in other "
            "batches and negative in some (flipping the loss's sign), so clamp_min or an eps "
            "would not fix it; normalise by what cannot cancel: the batch size (.mean()), the "
            "sum of |w|, or the weights' total over the whole training set")
