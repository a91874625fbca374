"""Rows a module call made non-finite after its origin op: a recurrence written as a Python loop
(RWKV's WKV over the time steps, a scan over a sequence) runs its ops once per step, and each
row may overflow at a step of its own, in the origin's op or a sibling (``exp(k)`` in one row,
``exp(k) * v`` in another). The origin's samples are every row an op of that module call made
non-finite of values finite in it, not only the first call's rows (dropping those alone would
leave the others' NaN); a row spoiled by another's non-finite value is not one. Nor is a row
whose infinity the next op to take it made finite again: an adaptive ODE solver's step factor
``(0.9 * ratio ** -0.2).clamp(0.2, 10)`` is +inf, then 10, in every row whose error is 0."""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Any

from recorder.finite import finite

from .compat import tree_leaves
from .dispatch import float_leaves
from .fresh import POINTWISE
from .strided_nested import on_strided_nested

# ops whose output row i is made of their first input's row i alone (the weights are shared):
# an encoder's convolution that overflows in float16 in rows of its own
_ROW_WISE = {"convolution", "_convolution"}


@dataclass
class _Widened:
    """The rows added to one origin, each with the value that holds its infinity now (held
    weakly): a row stays while no op has made that value finite again."""
    hit: Any
    base: set[int]
    pending: list[tuple[weakref.ref, set[int]]] = field(default_factory=list)
    of_data: bool | None = None  # the hit's evidence's, as its own rows set it

    def rows(self) -> list[int]:
        return sorted(self.base.union(*(r for _, r in self.pending)))


_WIDENED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # by OpFinder


def _settle(w: _Widened, leaves: list, outs: list, rows_of) -> bool:
    """Pending values this op takes: their rows follow its output while it is non-finite in
    them (``0.9 * inf``), dropped where it made them finite (a clamp, a ``where``); all kept
    when the output has no samples. Whether any was taken."""
    taken = [i for i, (ref, _) in enumerate(w.pending) if any(ref() is t for t in leaves)]
    if not taken:
        return False
    bad = next((t for t in outs if not finite(t)), None)
    still = None if bad is None else rows_of([bad])
    # (by position: weak references compare their tensors, elementwise)
    rows = [w.pending[i][1] for i in taken]
    w.pending = [p for i, p in enumerate(w.pending) if i not in taken]
    if bad is not None:
        w.pending += [(weakref.ref(bad), r if still is None else r & set(still)) for r in rows]
    return True


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
    if on_strided_nested(leaves, out):  # (math attention's, whose values no op here reads)
        return out
    w = _WIDENED.get(f)
    if w is None or w.hit is not hit:
        w = _WIDENED[f] = _Widened(hit, set(hit.rows))
    if early:  # (so that the rows of a value sorted after the origin name their samples,
        # also those a mask's pick keeps: ``log(gt)``'s -inf at the holes ``g[valid]`` drops)
        f.reordered.track(func.overloadpacket.__name__, args, leaves, out)
        f.moved.track(func.overloadpacket.__name__, args, leaves, out)
        if f.lineage is not None:
            f.lineage.track(func.overloadpacket.__name__, args, leaves, out)
    if _settle(w, leaves, float_leaves(out), f.batch_rows):
        _every_sample(f, w)
    outs = float_leaves(out)
    if all(finite(t) for t in outs):  # (batch_rows names the rows of a non-finite value)
        return out
    new = set(f.batch_rows(outs) or []) - set(w.rows())
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
        w.pending.append((weakref.ref(outs[0]), fresh))
        _every_sample(f, w)
    return out


def _every_sample(f: Any, w: _Widened) -> None:
    """Set the origin's rows to ``w``'s. Rows widened to every sample of the batch: the
    call's code hit the pole in each of them (Deformable DETR's valid ratios of an inverted
    mask, 0 in height for some images and in width for the others), not a degenerate record
    (``OpFinder.of_records``' rule, on the origin op's rows alone)."""
    w.hit.rows = w.rows()
    ev, size = w.hit.evidence, getattr(f.samples, "size", None)
    if ev is None or not size:
        return
    if w.of_data is None:
        w.of_data = ev.of_data
    ev.of_data = w.of_data and len(w.hit.rows) < size
