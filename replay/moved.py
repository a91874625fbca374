"""Values whose samples an op moved out of the dimension their shape says, or flattened.

MS-SSIM stacks its per-scale terms, each ``(B, C)``, into ``(levels, B, C)`` and raises them
to the scales' weights (pytorch-msssim's ``torch.stack(mcs + [ssim]) ** weights``); RAFT's
descendants stack the flow of every iteration, ``(iters, B, 2, H, W)``, and average each
image's error into ``(iters, B)``. Read by shape alone, a dim 0 of the batch's size holds the
samples: with as many scales or iterations as samples the op finder named those as the
samples, and with a multiple of the batch's size it named none. A pose loss flattens the
joints with the batch (dsntnn's ``gt.reshape(-1, 2)``, ``(B * K, 2)``; SPIN's axis-angle
poses ``(B, J * 3)`` as ``(B * J, 3)`` for Rodrigues): row ``r`` is sample ``r // K``, which
the shape does not say either.

:class:`Moved` follows the samples' dimension through the ops that move it — ``stack`` of
values that all hold it in one dimension, ``cat`` along it (the batch again for each part: an
occupancy net's ``cat([x, near])``), ``transpose``, ``permute`` (``movedim``), and, of a
followed value, ``unsqueeze``, ``squeeze``, ``select`` and reductions over other dimensions —
and through a ``view`` / ``reshape`` merging the samples with the dimensions after them (each
sample a ``group`` of consecutive rows) or with those before them too (wav2vec 2.0's
contrastive logits ``(1 + K, B, M)``, ``logits.transpose(0, 2).reshape(-1, 1 + K)``: row ``r``
is sample ``r % B``, the batch repeated ``reps`` times); and on through any op broadcasting
such a value into its output (``vals ** w``, ``preds - gt[None]``, a copy).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from recorder.capture import tensor_leaves
from recorder.finite import bad_rows
from recorder.samples import Samples

# reductions taking (x, dim, keepdim): over other dims, they keep the samples
_REDUCTIONS = {"sum", "mean", "nansum", "nanmean", "amax", "amin", "prod", "logsumexp"}
_VIEWS = {"view", "reshape", "_unsafe_view"}
# lookups of a table's rows by ids (nn.Embedding, ``memory[ids]``, ``index_select``)
_LOOKUPS = {"embedding", "index", "_unsafe_index", "index_select"}

# (the samples' dimension, the rows each sample holds there, how many times the batch's
# rows repeat along it): row r is sample (r // group) % size
Place = tuple[int, int, int]


class Moved:
    def __init__(self, samples: Samples | None):
        self.samples = samples
        self._of: dict[int, tuple[weakref.ref, Place]] = {}  # id -> (the tensor, its place)

    def place(self, t: torch.Tensor) -> Place | None:
        """Where an op moved ``t``'s samples, None when none did."""
        hit = self._of.get(id(t))
        return hit[1] if hit is not None and hit[0]() is t else None

    def rows(self, outs: list[torch.Tensor]) -> list[int] | None:
        """The non-finite samples of the first of ``outs`` whose samples an op moved."""
        for t in outs:
            if (p := self.place(t)) is not None:
                return sorted({(r // p[1]) % self.samples.size for r in bad_rows(t, p[0])})
        return None

    def same_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """``dst`` holds ``src``'s rows in its dim 0 (an entry taken from each): its samples
        are where an op moved ``src``'s, when that is dim 0."""
        p = self.place(src)
        if p is not None and p[0] == 0 and dst.dim() and dst.shape[0] == src.shape[0]:
            self._put(dst, p)

    def _where(self, t: Any, name: str = "") -> Place | None:
        """Where the samples of ``t`` are: followed, else as its shape says (a value a
        transpose moves read as made from the batch: ``(1 + K, B, M)`` logits hold them in
        dim 1)."""
        if not isinstance(t, torch.Tensor) or t.is_nested:
            return None
        p = self.place(t)
        d = self.samples.dim(t, stacked=name in ("transpose", "permute"))
        return p if p is not None else (d, 1, 1) if d is not None else None

    def track(self, name: str, args: Sequence[Any], leaves: list, out: Any) -> None:
        s = self.samples
        if not (s and s.size > 1) or not args:
            return
        outs = [out] if isinstance(out, torch.Tensor) else list(tensor_leaves(out))
        try:
            p = self._moved(name, args, outs)
        except (TypeError, ValueError, IndexError, ZeroDivisionError):
            return  # (arguments of an overload not foreseen: the shape says the samples)
        if p is not None or name in _VIEWS:  # (a view that mixes the samples: not followed)
            if p and outs and outs[0].dim() > p[0] \
                    and outs[0].shape[p[0]] == s.size * p[1] * p[2]:
                self._put(outs[0], p)
            return
        # an elementwise op (broadcasting) keeps a followed value's samples where they were,
        # counted from the right
        ts = [t for t in leaves if isinstance(t, torch.Tensor) and not t.is_nested]
        ends = {(q[0] - t.dim(), q[1], q[2]) for t in ts if (q := self.place(t)) is not None}
        if len(ends) != 1:
            return
        end, group, reps = ends.pop()
        for t in outs:
            d = t.dim() + end
            if d < 0 or t.shape[d] != s.size * group * reps \
                    or t.dim() < max(u.dim() for u in ts) \
                    or any(u.shape == t.shape and self.place(u) is None
                           and s.dim(u) not in (None, d) for u in ts):
                continue  # (a reduction; or beside a value of its shape read by its shape)
            self._put(t, (d, group, reps))

    def _moved(self, name: str, args: Sequence[Any], outs: list[torch.Tensor]) -> Place | None:
        """Where op ``name`` put the samples of its input, None when it moved none."""
        x = args[0]
        if name == "stack" and isinstance(x, (list, tuple)) and x:
            at = {self._where(t) for t in x}
            if len(at) != 1 or (p := at.pop()) is None:
                return None
            k = _arg(args, 1, 0) % (x[0].dim() + 1)
            return (p[0] + 1 if k <= p[0] else p[0], *p[1:])
        if name == "cat" and isinstance(x, (list, tuple)):
            return self._concatenated([t for t in x if t.numel()], _arg(args, 1, 0))
        if name in _LOOKUPS:
            return self._looked_up(name, args)
        if not isinstance(x, torch.Tensor) or (p := self._where(x, name)) is None:
            return None
        (s, group, reps), followed = p, self.place(x) is not None
        if name in _VIEWS and outs and s == 0 and reps > 1 and followed:  # (3B ids' rows, split)
            return _regrouped(x, outs[0], group, reps)
        if name == "transpose":
            a, b = (_arg(args, i, 0) % max(x.dim(), 1) for i in (1, 2))
            return (b if s == a else a if s == b else s, group, reps)
        if name == "permute":
            dims = [k % x.dim() for k in _arg(args, 1, ())]
            return (dims.index(s), group, reps) if s in dims else None
        if name in _VIEWS and outs and s > 0 and reps == 1 and followed:  # ((M, B, C): (M * B, C))
            return _merged(x, outs[0], s, group)
        if name in _VIEWS and outs and s == 0 and reps == 1:  # ((B, K, 2) as (B * K, 2); back)
            p = _flattened(x, outs[0], group)
            # (a view of a value read by shape that merges nothing, w.view(-1, 1, 1) of as
            # many weights as samples, is read so too)
            return p if followed or p is None or p[1] > 1 else None
        if not followed:  # (the rest keep what the shape reads, or lose it)
            return None
        if name == "unsqueeze":  # (of (B,) read by shape: (1, B) is read so too)
            return (s + 1 if _arg(args, 1, 0) % (x.dim() + 1) <= s else s, group, reps)
        if name == "squeeze":  # (a field's (N, 1) output as (N,); the samples' dim is > 1)
            dims = _arg(args, 1, range(x.dim()))
            dims = [dims] if isinstance(dims, int) else dims
            return (s - sum(k % x.dim() < s and x.shape[k] == 1 for k in dims), group, reps)
        if name == "select":
            k = _arg(args, 1, 0) % max(x.dim(), 1)
            return None if k == s else (s - (k < s), group, reps)
        if name in _REDUCTIONS:
            dims = _arg(args, 1, None)
            dims = [dims] if isinstance(dims, int) else dims
            if not dims or not all(isinstance(k, int) for k in dims):
                return None  # (over every dim)
            dims = {k % x.dim() for k in dims}
            keep = bool(_arg(args, 2, False))
            return None if s in dims else (s if keep else s - sum(k < s for k in dims), group,
                                           reps)
        return None

    def _looked_up(self, name: str, args: Sequence[Any]) -> Place | None:
        """Where a lookup of a table's rows by followed ids puts the samples: where the ids
        hold them (a memory of node states read for ``cat([src, dst, neg])``, ``(3B,)`` ids:
        row r is sample r % B), the output's leading dims being the ids'."""
        if name == "index_select":
            ids, dim = _arg(args, 2, None), _arg(args, 1, 0)
            p = self.place(ids) if isinstance(ids, torch.Tensor) and ids.dim() == 1 else None
            return p and (dim % args[0].dim(), *p[1:])
        ids = _arg(args, 1, None)
        if name != "embedding":  # (x[ids]: one index tensor, on dim 0)
            ids = ids[0] if isinstance(ids, (list, tuple)) and ids \
                and all(i is None for i in ids[1:]) else None
        if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.dtype is torch.bool:
            return None
        return self.place(ids)

    def _concatenated(self, parts: list[torch.Tensor], k: int) -> Place | None:
        """Where ``cat(parts, k)`` puts the samples all ``parts`` hold at one place: along ``k``,
        the batch once more per part (an SDF's surface points and the points sampled near them,
        ``cat([x, x + noise])``: row r is sample r % B); along another dim, where they were."""
        at = {self._where(t) for t in parts}
        if not parts or len(at) != 1 or (p := at.pop()) is None:
            return None
        k %= parts[0].dim()
        return (k, p[1], p[2] * len(parts)) if k == p[0] else p

    def follow(self, t: torch.Tensor, p: Place) -> None:
        """Follows ``t``, whose samples an op outside this tracker's run put at ``p``."""
        self._put(t, p)

    def _put(self, t: torch.Tensor, p: Place) -> None:
        self._of[id(t)] = (weakref.ref(t), p)


def _flattened(x: torch.Tensor, out: torch.Tensor, group: int) -> Place | None:
    """Where a view of ``x`` (its samples in dim 0, ``group`` rows each) puts them: merged
    with the dimensions after them, or split back; None when it mixes them otherwise."""
    if not out.dim() or not x.dim():
        return None
    n = x.shape[0] // group  # (the batch's size)
    for j in range(x.dim()):  # dims 0..j of x merged into out's dim 0
        if math.prod(x.shape[:j + 1]) == out.shape[0]:
            g = out.shape[0] // n
            return (0, g, 1) if g * n == out.shape[0] \
                and math.prod(x.shape[1:j + 1]) * group == g else None
    per_sample, per_row = x.numel() // max(n, 1), out[0].numel()
    if n and per_row and out.shape[0] > n and per_sample % per_row == 0 \
            and out.shape[0] == n * (per_sample // per_row):
        return (0, per_sample // per_row, 1)  # (a dim split: (B, J * 3) as (B * J, 3))
    if out.dim() > 1 and out.shape[0] == n and x.shape[0] == math.prod(out.shape[:1]) * group:
        return (0, 1, 1) if out.shape[1:].numel() * n == x.numel() else None
    return None


def _regrouped(x: torch.Tensor, out: torch.Tensor, group: int, reps: int) -> Place | None:
    """Where a view of ``x``, its samples in dim 0 (``group`` rows each, the batch repeated
    ``reps`` times), puts them: dims after them merged into dim 0 (a head split's ``(3B * H,
    L, d)``), or split from it back."""
    if not out.dim():
        return None
    for j in range(x.dim()):
        if math.prod(x.shape[:j + 1]) == out.shape[0]:
            return (0, group * math.prod(x.shape[1:j + 1]), reps)
    for j in range(1, out.dim()):
        if math.prod(out.shape[:j + 1]) == x.shape[0]:
            m = math.prod(out.shape[1:j + 1])
            return (0, group // m, reps) if group % m == 0 else None
    return None


def _merged(x: torch.Tensor, out: torch.Tensor, s: int, group: int) -> Place | None:
    """Where a view of ``x`` merging its dims 0..j (j >= s, the samples' ``s``) into its dim 0
    puts the samples: the batch repeated once for each index of the dims before ``s``."""
    for j in range(s, x.dim()):
        if math.prod(x.shape[:j + 1]) == out.shape[0]:
            return (0, math.prod(x.shape[s + 1:j + 1]) * group, math.prod(x.shape[:s]))
    return None


def _arg(args: Sequence[Any], i: int, default: Any) -> Any:
    return args[i] if len(args) > i else default
