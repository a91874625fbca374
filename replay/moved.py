"""Values whose samples an op moved out of the dimension their shape says.

MS-SSIM stacks its per-scale terms, each ``(B, C)``, into ``(levels, B, C)`` and raises them
to the scales' weights (pytorch-msssim's ``torch.stack(mcs + [ssim]) ** weights``). Read by
shape alone, a dim 0 of the batch's size holds the samples: with as many scales as samples
(two of each) the op finder named the scale of a negative contrast term as the sample, and
with a multiple of the batch's size as many scales it named none. :class:`Moved` follows the
samples' dimension through the ops that move it — ``stack`` of values that all hold it in one
dimension, ``unsqueeze``, ``transpose``, ``permute`` (``movedim``) — and on through any op
broadcasting such a value into its output (``vals ** w``, ``preds - gt[None]``, a copy).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from recorder.capture import tensor_leaves
from recorder.finite import bad_rows
from recorder.samples import Samples


# reductions taking (x, dim, keepdim): over other dims, they keep the samples
_REDUCTIONS = {"sum", "mean", "nansum", "nanmean", "amax", "amin", "prod", "logsumexp"}


class Moved:
    def __init__(self, samples: Samples | None):
        self.samples = samples
        self._of: dict[int, tuple[weakref.ref, int]] = {}  # id -> (the tensor, its dim)

    def dim(self, t: torch.Tensor) -> int | None:
        """The dimension an op moved ``t``'s samples to, None when none did."""
        hit = self._of.get(id(t))
        return hit[1] if hit is not None and hit[0]() is t else None

    def rows(self, outs: list[torch.Tensor]) -> list[int] | None:
        """The non-finite samples of the first of ``outs`` whose samples an op moved."""
        return next((bad_rows(t, d) for t in outs if (d := self.dim(t)) is not None), None)

    def _where(self, t: Any) -> int | None:
        """The samples' dimension of ``t``: followed, else as its shape says."""
        if not isinstance(t, torch.Tensor) or t.is_nested:
            return None
        d = self.dim(t)
        return d if d is not None else self.samples.dim(t)

    def track(self, name: str, args: Sequence[Any], leaves: list, out: Any) -> None:
        s = self.samples
        if not (s and s.size > 1) or not args:
            return
        outs = [out] if isinstance(out, torch.Tensor) else list(tensor_leaves(out))
        d = self._moved(name, args)
        if d is not None and outs and outs[0].dim() > d and outs[0].shape[d] == s.size:
            self._put(outs[0], d)
            return
        # an elementwise op (broadcasting) keeps a followed value's samples where they were,
        # counted from the right
        ts = [t for t in leaves if isinstance(t, torch.Tensor) and not t.is_nested]
        ends = {self.dim(t) - t.dim() for t in ts if self.dim(t) is not None}
        if len(ends) != 1:
            return
        end = ends.pop()
        for t in outs:
            d = t.dim() + end
            if d < 0 or t.shape[d] != s.size or t.dim() < max(u.dim() for u in ts) or any(
                    u.shape == t.shape and self.dim(u) is None and s.dim(u) not in (None, d)
                    for u in ts):
                continue  # (a reduction; or beside a value of its shape read by its shape)
            self._put(t, d)

    def _moved(self, name: str, args: Sequence[Any]) -> int | None:
        """Where op ``name`` put the samples of its input, None when it moved none."""
        x = args[0]
        if name == "stack" and isinstance(x, (list, tuple)) and x:
            at = {self._where(t) for t in x}
            if len(at) != 1 or (s := at.pop()) is None:
                return None
            k = _arg(args, 1, 0) % (x[0].dim() + 1)
            return s + 1 if k <= s else s
        if not isinstance(x, torch.Tensor) or (s := self._where(x)) is None:
            return None
        if name == "unsqueeze" and self.dim(x) is not None:  # ((B,) read by shape: (1, B)
            # is read so too, and a (K,) of K = B read so was never the samples': w[:, None])
            k = _arg(args, 1, 0) % (x.dim() + 1)
            return s + 1 if k <= s else s
        if name == "transpose":
            a, b = (_arg(args, i, 0) % max(x.dim(), 1) for i in (1, 2))
            return b if s == a else a if s == b else s
        if name == "permute":
            dims = [k % x.dim() for k in _arg(args, 1, ())]
            return dims.index(s) if s in dims else None
        if name in _REDUCTIONS and self.dim(x) is not None:  # (one the shape reads: as is)
            dims = _arg(args, 1, None)
            dims = [dims] if isinstance(dims, int) else dims
            if not dims or not all(isinstance(k, int) for k in dims):
                return None  # (over every dim)
            dims = {k % x.dim() for k in dims}
            keep = bool(_arg(args, 2, False))
            return None if s in dims else s if keep else s - sum(k < s for k in dims)
        return None

    def _put(self, t: torch.Tensor, d: int) -> None:
        self._of[id(t)] = (weakref.ref(t), d)


def _arg(args: Sequence[Any], i: int, default: Any) -> Any:
    return args[i] if len(args) > i else default
