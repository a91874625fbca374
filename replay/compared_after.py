"""A data-only origin the loss compares with the same op of the model's output, when that
origin made NaN at once.

An NDVI consistency term ``l1(ndvi(pred), ndvi(target))`` over a target with nodata pixels:
the target's ``(nir - red) / (nir + red)`` is 0/0 there. The finder follows no op after a
NaN origin (its early return), so the ``sub`` that takes both ratios was never seen and
the hint called the target a degenerate record to drop, where the fix is a mask of its
nodata (the log-magnitude L1 of a zero-padded clip, whose -inf is followed, gets that
advice already: :mod:`replay.lineage`). :func:`after_origin`, the finder's early return,
feeds those later ops to the lineage's comparison alone, and marks the origin's evidence
``compared`` when one took the origin op's output beside the same op's on a learned value.
"""

from __future__ import annotations

from typing import Any

from .compat import running_node, tree_leaves
from .dispatch import float_leaves, run_op
from .landed_rows import land_rows
from .recurring import widen_rows


def after_origin(f: Any, func, args, kwargs):
    """An op after the NaN origin of ``f`` (an :class:`~replay.ops.OpFinder`): run, the rows
    it made non-finite widened (:func:`~replay.recurring.widen_rows`), its comparison noted."""
    f.differentiated = f.differentiated or running_node() is not None
    out = widen_rows(f, func, args, kwargs, run_op(func, args, kwargs), early=True)
    land_rows(f, tree_leaves((args, kwargs)), float_leaves(out))  # (an origin without rows)
    return note_compared(f, func, args, kwargs, out)


def note_compared(f: Any, func, args, kwargs, out):
    """After the origin of ``f`` (an :class:`~replay.ops.OpFinder`), see whether ``func``
    compares its data-only result with the model's; returns ``out``."""
    hit = f.first
    ev = hit.evidence if hit is not None else None
    if f.lineage is None or ev is None or not ev.of_data or ev.compared:
        return out
    f.lineage.compare(func.overloadpacket.__name__, tree_leaves((args, kwargs)), out)
    ev.compared = hit.op.removeprefix("aten.").rstrip("_") in f.lineage.compared
    return out
