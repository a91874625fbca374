"""An index op that picked an intended fill's infinity out of its input.

A policy's ``log_softmax(logits.masked_fill(~valid, -inf)).gather(-1, action)`` is finite for
every action the mask allows; an action it forbids (an exploration mixing in a uniform over
every action, valid or not) picks the fill's ``-inf``, which then reaches the output as a
log-probability. The fill is intended and no op made an infinity of finite values, so the
finder had only the fill (often another one, of another mask) to name. The op finder keeps
the first such pick (:func:`note_pick`); the forward report blames it when an infinity and no
NaN reached the output (:func:`picked_hint` says why). A loss that sums such a pick is named
at its reduction, and :func:`folded_pick_hint` says what was picked: a monotonic transducer's
or a CTC recursion's final cell ``alphas[b, T_b, U_b]`` still at its -inf start value, for an
utterance with more labels than frames (no path reaches that cell).
"""

from __future__ import annotations

import torch

from recorder.finite import finite, kind_of

from .earlier_nan import dropped_nan
from .hits import OpHit
from .source import user_source

__all__ = ["folded_pick_hint", "note_pick", "picked_hint", "picked_origin"]

# ops that copy entries of their input chosen by an index (not a reduction, not arithmetic)
_PICKS = {"gather", "index", "index_select", "take_along_dim", "take"}


def note_pick(f, name: str, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
    """Keep on ``f.picked`` the first index op (``name``, its count just taken) that took an
    infinity out of NaN-free inputs after an intended fill, with the rows that hold it."""
    if f.picked is not None or f.intentional is None or f.first is not None \
            or name not in _PICKS or not outs or finite(outs[0]) \
            or any(kind_of(t) == "nan" for t in ins if not finite(t)):
        return
    if (made := kind_of(outs[0])) in ("+inf", "-inf"):
        f.picked = OpHit(f"aten.{name}", made, user_source(), None, None, False,
                         f.counts[name] - 1, False, rows=f.batch_rows(outs), within=f.where,
                         seq=f.seen - 1)


def picked_origin(finder, hit: OpHit | None, kind: str | None):
    """``(hit, None)``, or when ``hit`` is a NaN the call dropped before its output, which
    holds only infinities (``kind``): ``(pick, pick)`` for the index op that picked a fill's
    infinity of that sign (a masked action's log-probability), else ``(None, None)``, the fill
    then. The dropped NaN leaves the finder's chain."""
    if not dropped_nan(hit, finder.first, finder.first_nan, kind):
        return hit, None
    pick = finder.picked if finder.picked and finder.picked.made == kind else None
    finder.first, finder.first_nan = pick, None
    return pick, pick


def picked_hint(hit: OpHit) -> str:
    return (f"{hit.op} picked an entry a mask had filled with {hit.made} on purpose: "
            "its index (a sampled action, a target) points at an entry the mask forbids, so "
            "its log-probability is -inf; make the index and the mask agree (sample only "
            "allowed entries: mix an exploration's uniform over the allowed ones, renormalised)"
            " or drop those rows")


def folded_pick_hint(hit: OpHit) -> str | None:
    """The hint for a reduction (``hit``) that folded in the infinity an index op picked out
    of a value holding an intended fill; None when no pick came first."""
    pick = hit.picked
    if pick is None:
        return None
    return (f"{hit.op} folded in the {pick.made} that {pick.op} ({pick.source}) read out of a "
            "value holding an infinity put there on purpose (a mask or a recursion's start "
            "value): at the samples named it read entries no finite value reached, so their "
            "likelihood is 0: a target or action the mask forbids (a target on a masked class, "
            "a gold tag path through a masked transition), or a lattice's final cell that no "
            "path reaches (an alignment of more labels than frames: a monotonic transducer's "
            "or CTC's target longer than its input). Make the index and the mask agree, or "
            "drop or fix those samples (filter those whose targets outnumber their frames), or "
            "give their loss 0 as CTC's zero_infinity=True does")
