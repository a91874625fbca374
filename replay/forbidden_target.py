"""A hard-target NLL that took a log-probability of -inf: the target is a class the mask forbids.

``cross_entropy(scores.masked_fill(seen, -inf), target)`` is finite for every target the mask
allows; a target it forbids (a recommender's seen-items mask built from the whole log, the
held-out next item included; a label on a class masked out) has probability 0 and loss +inf.
The mask is intended (under ``allow_inf``) and no op made the infinity; the generic advice
(zero weight for masked classes, label smoothing) is not the fix: the target and the mask
disagree.
"""

from __future__ import annotations

# the hard-target NLL ops: they read one entry per row, the target's
NLL = {"nll_loss_forward", "nll_loss2d_forward", "nll_loss_nd"}


def forbidden_target_hint(name: str, made: str) -> str | None:
    """The hint for aten op ``name`` (no ``aten.``, no overload) that folded a -inf
    log-probability into ``made``; None for any other op."""
    if name not in NLL or made != "+inf":
        return None
    return (f"aten.{name} read each sample's target log-probability, and for the samples "
            "named it is -inf: their target is a class a mask set to -inf on purpose (a target "
            "on a masked class), so the mask forbids the very answer (a seen-items mask built with the held-out item in "
            "it, a split by row instead of by time; a label on a class masked out): make the "
            "target and the mask agree (unmask each row's target: seen[rows, target] = False), "
            "or drop those rows")
