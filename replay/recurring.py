"""Rows a module call made non-finite after its origin op: a recurrence written as a Python loop
(RWKV's WKV over the time steps, a scan over a sequence) runs its ops once per step, and each
row may overflow at a step of its own, in the origin's op or a sibling (``exp(k)`` in one row,
``exp(k) * v`` in another). The origin's samples are every row an op of that module call made
non-finite of values finite in it, not only the first call's rows (dropping those alone would
leave the others' NaN); a row spoiled by another's non-finite value is not one."""

from __future__ import annotations

import math
from typing import Any

from recorder.finite import finite

from .compat import tree_leaves
from .dispatch import float_leaves
from .fresh import POINTWISE

# ops whose output row i is made of their first input's row i alone (the weights are shared):
# an encoder's convolution that overflows in float16 in rows of its own
_ROW_WISE = {"convolution", "_convolution"}


def widen_rows(f: Any, func, args, kwargs, out, early: bool = False):
    """Add to ``f.first.rows`` (an :class:`~replay.ops.OpFinder`'s forward origin) the rows a
    later op of the same module call made non-finite while its inputs were finite in them:
    in every row, unless the op is pointwise (which mixes no rows) and its non-finite inputs
    have the batch's samples. Fills of a literal infinity (a mask) and code of modules
    allowed to hold infinities make none. ``early``: the finder's early return, which
    follows no reordering or lineage of its own. Returns ``out``."""
    hit = f.first
    if hit is None or not hit.rows or hit.intentional or not hit.inputs_finite \
            or f.where != hit.within or f.in_allowed_module():
        return out
    leaves = tree_leaves((args, kwargs))
    if early:  # (so that the rows of a value sorted after the origin name their samples)
        f.reordered.track(func.overloadpacket.__name__, args, leaves, out)
        f.moved.track(func.overloadpacket.__name__, args, leaves, out)
        if f.lineage is not None:
            f.lineage.track(func.overloadpacket.__name__, args, leaves, out)
    outs = float_leaves(out)
    if all(finite(t) for t in outs):  # (batch_rows names the rows of a non-finite value)
        return out
    new = set(f.batch_rows(outs) or []) - set(hit.rows)
    ins = float_leaves(leaves)
    if not new or not ins or any(isinstance(a, float) and math.isinf(a) for a in leaves):
        return out
    spoiled: set[int] = set()
    row_wise = func.overloadpacket.__name__ in _ROW_WISE
    for t in ins:
        if finite(t):
            continue
        # (its rows named as the op's own are: through a reordering, say)
        d = f.samples.dim(t, stacked=True)
        own = (POINTWISE in func.tags and d is not None) \
            or (row_wise and d == 0 and bool(args) and t is args[0])
        rows = f.batch_rows([t]) if own else None
        if not rows:  # (an op mixing rows, or a non-finite value without samples: all rows)
            return out
        spoiled |= set(rows)
    if fresh := new - spoiled:
        hit.rows = sorted(set(hit.rows) | fresh)
    return out
