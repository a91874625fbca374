"""Values whose rows are the batch's samples in another order, or picked out of them.

A Cox partial likelihood sorts the batch by follow-up time before its risk sets' cumulative
sum (``order = argsort(time, descending=True)``; ``risk[order]``): row ``r`` of the sorted
values holds sample ``order[r]``, not sample ``r``. The op finder named an overflow in
``exp(risk[order])`` by its row in the sorted order, a healthy sample. :class:`Reordered`
follows such reorderings: an integer index of the batch's length along dim 0 (``x[order]``,
``index_select``), ``sort`` of a 1-d value of the batch's length (its values in the order of
its indices), ``flip`` along the samples (a reverse cumulative sum), a slice of the samples
(``x[:B // 2]``), and, from them, every op whose inputs with the batch's rows were all
reordered the same way (``exp``, ``cumsum``, ``risk - log_risk``); :meth:`Reordered.samples`
turns rows back into samples. An op over the rows in two orders pairs them: the learning-loss
ranking's ``(pred - pred.flip(0))[:B // 2]`` holds samples ``r`` and ``B - 1 - r`` in row
``r``, both named (one column of samples per order).

A boolean mask over the samples' leading dimensions picks values out of them the same way
(a depth loss's ``log(pred[valid])``, a segmentation loss's ``loss[labels != 255]``): row
``r`` of the picked values belongs to the sample of the mask's ``r``-th true element. Those
rows are followed too, and named as their samples (:meth:`Reordered.picked_rows`), also
where the mask picks among the tokens of a value flattened with its samples' rows first (an
LM loss's ``logits.reshape(-1, V)[targets.view(-1) != -100]``): row ``r`` of that view holds
sample ``r // T``.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from recorder.capture import tensor_leaves
from recorder.finite import bad_rows


class Reordered:
    def __init__(self, size: int):
        self.size = size
        # id -> (the tensor, the sample in each of its rows: a 1-d int64 tensor on the CPU)
        self._of: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
        self._masks: dict[int, tuple[weakref.ref, torch.Tensor]] = {}  # a mask's picks
        self._identity = torch.arange(max(size, 0))  # (the batch's own order)

    def order(self, t: torch.Tensor) -> torch.Tensor | None:
        """The sample in each row of ``t``, None when its rows are in the batch's order."""
        hit = self._of.get(id(t))
        return hit[1] if hit is not None and hit[0]() is t else None

    def samples(self, t: torch.Tensor, rows: list[int] | None) -> list[int] | None:
        order = self.order(t)
        if order is None or not rows:
            return rows
        return sorted(set(order[[r for r in rows if r < len(order)]].flatten().tolist()))

    def picked_rows(self, outs: list[torch.Tensor]) -> list[int] | None:
        """The samples of the non-finite rows of the first output a mask picked out of the
        batch (rows not the batch's own), or None."""
        for t in outs:
            order = self.order(t)
            if order is not None and not t.is_nested and t.dim() and t.shape[0] != self.size:
                return self.samples(t, bad_rows(t, 0)) or None
        return None

    def track(self, name: str, args: Sequence[Any], leaves: list, out: Any) -> None:
        if self.size < 2:
            return
        outs = [out] if isinstance(out, torch.Tensor) else list(tensor_leaves(out))
        made = self._made(name, args, outs)
        if made is not None:
            for t, order in made:
                self._put(t, order)
            return
        # the inputs with rows of samples: the batch's own (None) or followed ones
        found: list[torch.Tensor | None] = []
        for t in leaves:
            o = self.order(t) if isinstance(t, torch.Tensor) else None
            if (o is not None or self._rowed(t)) and not any(_same(o, f) for f in found):
                found.append(o)
        if len(found) > 1:  # (rows of the batch against their reordering: pairs of samples)
            if (order := _paired(found, self._identity)) is None:
                return
        elif not found or (order := found[0]) is None:
            return
        for t in outs:
            if isinstance(t, torch.Tensor) and not t.is_nested and t.dim() \
                    and t.shape[0] == len(order):
                self._put(t, order)

    def _made(self, name: str, args: Sequence[Any], outs: list[torch.Tensor]):
        """The outputs an index, a sort or a mask reordered, with the sample in each of their
        rows."""
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if x is None or not outs or not (self._rowed(x) or self.order(x) is not None):
            return None
        before = self.order(x)
        before = self._identity if before is None else before
        n = len(before)
        if (picked := self._picked(name, args, x, n)) is not None:
            return [(outs[0], before[picked])]
        if (g := _merged_rows(name, x, outs[0], n)) is not None:
            return [(outs[0], before.repeat_interleave(g, dim=0))]
        if (kept := _sliced_rows(name, args, x, n)) is not None:
            return [(outs[0], before[kept])]
        if x.dim() == 0 or x.shape[0] != n or not isinstance(outs[0], torch.Tensor) \
                or outs[0].is_nested or outs[0].dim() == 0 or outs[0].shape[0] != n:
            return None
        if name == "index" and len(args) > 1 and isinstance(args[1], (list, tuple)) \
                and args[1] and isinstance(args[1][0], torch.Tensor):
            idx = args[1][0]
        elif name == "index_select" and len(args) > 2 and args[1] == 0:
            idx = args[2]
        elif name == "sort" and x.dim() == 1 and len(outs) == 2:
            idx = outs[1]
        elif name == "flip" and len(args) > 1 and 0 in [d % x.dim() for d in args[1]]:
            idx = torch.arange(n - 1, -1, -1)  # (a reverse cumsum: flip, cumsum, flip)
        else:
            return None
        if idx.dtype not in (torch.int64, torch.int32) or idx.dim() != 1 or len(idx) != n:
            return None
        order = before[idx.cpu()]
        return [(outs[0], order)] + ([(outs[1], order)] if name == "sort" else [])

    def _picked(self, name: str, args: Sequence[Any], x: torch.Tensor, rows: int
                ) -> torch.Tensor | None:
        """The row of ``x`` each row of a boolean mask's pick came from (one per mask: a
        loss picks its prediction and its target with the same one)."""
        m = _mask(name, args, x, rows)
        if m is None:
            return None
        hit = self._masks.get(id(m))
        if hit is None or hit[0]() is not m:
            hit = self._masks[id(m)] = (weakref.ref(m), m.detach().nonzero()[:, 0].cpu())
        return hit[1]

    def follow(self, t: torch.Tensor, order: torch.Tensor) -> None:
        """``t``'s rows hold the samples ``order`` (found by another watch: the caller's)."""
        self._put(t, order)

    def _rowed(self, t: Any) -> bool:
        # (a nested tensor has no sizes to read: never reordered here)
        return isinstance(t, torch.Tensor) and not t.is_nested and t.dim() > 0 \
            and t.shape[0] == self.size

    def _put(self, t: torch.Tensor, order: torch.Tensor) -> None:
        if len(order) == self.size and torch.equal(order, torch.arange(self.size)):
            self._of.pop(id(t), None)  # (sorted back: the batch's order again)
        else:
            self._of[id(t)] = (weakref.ref(t), order)


def _mask(name: str, args: Sequence[Any], x: torch.Tensor, rows: int) -> torch.Tensor | None:
    """The boolean mask over ``x``'s leading dimensions that ``x[mask]`` or
    ``masked_select`` (its result flat) picks with, or None."""
    if name == "index" and len(args) > 1 and isinstance(args[1], (list, tuple)) \
            and len(args[1]) == 1 and isinstance(args[1][0], torch.Tensor):
        m = args[1][0]
    elif name == "masked_select" and len(args) > 1 and isinstance(args[1], torch.Tensor) \
            and args[1].dim() == x.dim() and tuple(args[1].shape) == tuple(x.shape):
        m = args[1]  # (a mask broadcast to x is not followed)
    else:
        return None
    if m.dtype != torch.bool or m.dim() == 0 or m.dim() > x.dim() or m.shape[0] != rows \
            or tuple(m.shape) != tuple(x.shape[:m.dim()]):
        return None
    return m


def _merged_rows(name: str, x: torch.Tensor, out: Any, n: int) -> int | None:
    """How many rows of a view of ``x`` each of its ``n`` rows became, when the view merged
    dim 0 with the dims after it (an LM loss's ``logits.reshape(-1, V)`` before its
    ``flat[valid]`` over the tokens), else None."""
    if name not in ("view", "reshape", "_unsafe_view") or not isinstance(out, torch.Tensor) \
            or out.is_nested or x.dim() < 2 or out.dim() == 0 or x.shape[0] != n:
        return None
    for j in range(1, x.dim()):
        g = math.prod(x.shape[1:j + 1])
        if g > 1 and out.shape[0] == n * g:
            return g
    return None


def _sliced_rows(name: str, args: Sequence[Any], x: torch.Tensor, n: int
                 ) -> torch.Tensor | None:
    """The rows of ``x`` a slice along dim 0 kept (``pairs[:B // 2]``), else None."""
    if name != "slice" or x.dim() == 0 or x.shape[0] != n or len(args) < 2 or args[1] != 0:
        return None
    start, end, step = (list(args[2:5]) + [None, None, None])[:3]
    return torch.arange(n)[slice(start, end, step)]


def _paired(found: list[torch.Tensor | None], identity: torch.Tensor) -> torch.Tensor | None:
    """The samples in each row of an op over several orders of the same rows (the learning
    loss's ``pred - pred.flip(0)``: row ``r`` holds samples ``r`` and ``B - 1 - r``), one
    column per order; None where they differ in length (a pick beside the batch)."""
    if any(o is not None and len(o) != len(identity) for o in found):
        return None
    cols = [(identity if o is None else o).reshape(len(identity), -1) for o in found]
    return torch.cat(cols, 1)


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is b or (a is not None and b is not None and len(a) == len(b)
                      and torch.equal(a, b))
