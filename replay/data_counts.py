"""Counts the batch carries (reads per base, region or bin; events), 0 in some samples' rows,
at a log's or a normalisation's pole.

BPNet trains its count head on ``log(1 + total)`` of a region's reads and its profile head on
the reads over their total; written as ``log(total)`` or ``counts / counts.sum(-1)``, a region
with no read in a track (a background region, a track with no coverage there) makes -inf or
0/0. The op took the data alone, so the hint said the record is degenerate and an eps would
make up a target; but a count of 0 is an ordinary record of a count model, and a pseudo-count
(a floored total, whose quotient is then 0: its terms drop out) is the fix. :func:`marked`
tells the op finder's evidence so where every input of the op is whole numbers >= 0 with some
above 1 (not a 0/1 mask, nor a normalised value), a divisor being its dividend's sum over a
dim, and gives the advice the hint ends with.

A 0 standing apart from the rest of the data may be no small count: a MIDI note-on of velocity 0
(the protocol's note-off) among velocities of 40..110 under a log-normal velocity loss's
``log(v)``, where ``log1p`` would train the model on a note-off. Values alone cannot tell it
from a region's total of reads, of 161 or more, with one region of none; where no value lies
between 0 and ``GAP`` (the smallest nonzero one is ``GAP`` or more) the hint says so, and
what to do if the data is no count: re-code or filter those entries where the data is made.
"""

from __future__ import annotations

import torch

_LOGS = {"log", "log2", "log10"}
_DIVIDES = {"div", "true_divide", "divide"}

# (said by both texts: the data's 0 is a true value, no record to filter: replay.zero_records)
ORDINARY = "is an ordinary record"
LOG = ("what it took there was computed from the batch's data alone and holds whole numbers "
       ">= 0 (counts: reads per region or bin, events, a stay's whole days), 0 at the samples "
       f"named: a count of 0 {ORDINARY} (a region with no read in that track, a discharge on "
       "the day of admission), not a degenerate one, so "
       "don't drop it: take the log with a pseudo-count, torch.log1p(count) (log(1 + count), "
       "as a count head's target is) or log(count + c) on both sides of the loss")
GAP = 8  # (the smallest nonzero value from which a 0 stands apart: no count 1..GAP-1 held)
APART = ("; but no value lies between 0 and {low} (the data's smallest nonzero one): if "
         "the data is no count (a MIDI note-on of velocity 0 is the protocol's note-off, a "
         "level never measured filled with 0), that 0 stands apart from its range as a code for "
         "something else: re-code or filter those entries where the data is made (or mask "
         "them out of the loss), as a pseudo-count would train on a value the data never "
         "meant")
NORMALISED = ("it divided counts the batch carries (whole numbers >= 0: reads per position, "
              "events) by their total, which is 0 at the samples named: a row with no count "
              "(a region with no read in that track) " + ORDINARY + ", not a degenerate "
              "one: divide by total.clamp_min(1), which leaves its normalised counts all 0 so "
              "that its terms drop out of the loss, or mask such rows out of that term")


def marked(op: str, ins: list[torch.Tensor]) -> str:
    """The advice for ``op``, a log of counts or a quotient of counts by counts (see the
    module), else ""."""
    name = op.removeprefix("aten.").split(".")[0].rstrip("_")
    if name in _LOGS and len(ins) == 1 and _counts(ins[0]):
        low = _apart(ins[0])
        return LOG if low is None else LOG + APART.format(low=f"{low:g}")
    if name in _DIVIDES and len(ins) == 2 and all(_counts(t) for t in ins) \
            and _own_total(*ins):
        return NORMALISED
    return ""


def _own_total(counts: torch.Tensor, total: torch.Tensor) -> bool:
    """``total`` is ``counts`` summed over a dim it keeps as 1 (a profile's reads over their
    total, not a box's area over another's)."""
    if total.dim() != counts.dim():
        return False
    return any(t == 1 < c and torch.equal(counts.sum(d, keepdim=True), total.to(counts.dtype))
               for d, (c, t) in enumerate(zip(counts.shape, total.shape)))


def _counts(t) -> bool:
    if not isinstance(t, torch.Tensor) or t.is_complex() or t.dtype == torch.bool:
        return False
    x = t.detach()
    x = x[torch.isfinite(x)] if x.is_floating_point() else x
    return bool(x.numel()) and bool((x >= 0).all() and (x == x.round()).all() and (x > 1).any())


def _apart(t: torch.Tensor) -> float | None:
    """The smallest nonzero value of counts ``t`` holding a 0, where it is ``GAP`` or more (the
    0 stands apart); None otherwise."""
    x = t.detach()
    x = x[torch.isfinite(x)] if x.is_floating_point() else x
    nonzero = x[x != 0]
    if not nonzero.numel() or nonzero.numel() == x.numel():
        return None
    low = float(nonzero.min())
    return low if low >= GAP else None
