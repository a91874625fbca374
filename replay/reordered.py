"""Values whose rows are the batch's samples in another order.

A Cox partial likelihood sorts the batch by follow-up time before its risk sets' cumulative
sum (``order = argsort(time, descending=True)``; ``risk[order]``): row ``r`` of the sorted
values holds sample ``order[r]``, not sample ``r``. The op finder named an overflow in
``exp(risk[order])`` by its row in the sorted order, a healthy sample. :class:`Reordered`
follows such reorderings: an integer index of the batch's length along dim 0 (``x[order]``,
``index_select``), ``sort`` of a 1-d value of the batch's length (its values in the order of
its indices), ``flip`` along the samples (a reverse cumulative sum), and, from them, every
op whose inputs with the batch's rows were all reordered the same way (``exp``, ``cumsum``, ``risk - log_risk``); :meth:`Reordered.samples` turns rows
back into samples.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from recorder.capture import tensor_leaves


class Reordered:
    def __init__(self, size: int):
        self.size = size
        self._of: dict[int, tuple[weakref.ref, tuple[int, ...]]] = {}

    def order(self, t: torch.Tensor) -> tuple[int, ...] | None:
        """The sample in each row of ``t``, None when its rows are in the batch's order."""
        hit = self._of.get(id(t))
        return hit[1] if hit is not None and hit[0]() is t else None

    def samples(self, t: torch.Tensor, rows: list[int] | None) -> list[int] | None:
        order = self.order(t)
        if order is None or not rows:
            return rows
        return sorted({order[r] for r in rows if r < len(order)})

    def track(self, name: str, args: Sequence[Any], leaves: list, out: Any) -> None:
        if self.size < 2:
            return
        outs = [out] if isinstance(out, torch.Tensor) else list(tensor_leaves(out))
        made = self._made(name, args, outs)
        if made is not None:
            for t, order in made:
                self._put(t, order)
            return
        rowed = [t for t in leaves if self._rowed(t)]
        orders = {self.order(t) for t in rowed}
        if len(orders) == 1 and (order := orders.pop()) is not None:
            for t in outs:
                if self._rowed(t):
                    self._put(t, order)

    def _made(self, name: str, args: Sequence[Any], outs: list[torch.Tensor]):
        """The outputs an index or a sort reordered, with the sample in each of their rows."""
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if x is None or not self._rowed(x) or not outs or not self._rowed(outs[0]):
            return None
        if name == "index" and len(args) > 1 and isinstance(args[1], (list, tuple)) \
                and args[1] and isinstance(args[1][0], torch.Tensor):
            idx = args[1][0]
        elif name == "index_select" and len(args) > 2 and args[1] == 0:
            idx = args[2]
        elif name == "sort" and x.dim() == 1 and len(outs) == 2:
            idx = outs[1]
        elif name == "flip" and len(args) > 1 and 0 in [d % x.dim() for d in args[1]]:
            idx = torch.arange(self.size - 1, -1, -1)  # (a reverse cumsum: flip, cumsum, flip)
        else:
            return None
        if idx.dtype not in (torch.int64, torch.int32) or idx.dim() != 1 \
                or len(idx) != self.size:
            return None
        before = self.order(x) or range(self.size)
        order = tuple(before[i] for i in idx.tolist())
        return [(outs[0], order)] + ([(outs[1], order)] if name == "sort" else [])

    def _rowed(self, t: Any) -> bool:
        # (a nested tensor has no sizes to read: never reordered here)
        return isinstance(t, torch.Tensor) and not t.is_nested and t.dim() > 0 \
            and t.shape[0] == self.size

    def _put(self, t: torch.Tensor, order: tuple[int, ...]) -> None:
        if order == tuple(range(self.size)):  # (sorted back: the batch's order again)
            self._of.pop(id(t), None)
        else:
            self._of[id(t)] = (weakref.ref(t), order)
