"""Where a step's statistics are computed and kept until the step closes.

Every statistic the recorder takes (an output's min and max, an input's sum, a gradient's
squared norm) is one float32 number on the model's device, computed by a reduction that writes
with ``out=`` into a slot of a preallocated vector. Allocating a 0-d tensor per statistic would
cost more than the allocation itself: on CPU, small tensors that live until the step closes
fragment glibc's heap, so the training step's own large buffers stop reusing freed memory, land
on fresh pages and page-fault (CNN benchmark: ~1,300 extra faults and ~4 ms more in the model's
own backward kernels per step).

The slots are split into regions by how a statistic is checked at the step's end:

- ``STRICT``: must be finite (outputs, root inputs, loss, parameter norms);
- ``GRAD``: gradient norms: must be finite unless a GradScaler skipped the step;
- ``NAN_ONLY``: must not be NaN (outputs of modules allowed to hold +-Inf);
- ``LOOSE``: kept, never checked (inner calls' inputs, means, spreads).

A statistic is named by a ref ``(region, index)``; ``(RELU_OF + region, index)`` names the ReLU
of that slot, a value no slot holds, applied where a row is decoded (see :meth:`Slots.relu`). The regions are consecutive parts of one
vector, so closing the step copies that whole vector into the next ring row in one device op,
behind the last update's evidence, and checks the row's ``STRICT`` (+ ``GRAD``) part with one
more and its ``NAN_ONLY`` part with a third (:meth:`recorder.ring.RingBuffer.reserve` and
``probe_finite``). Slots a step did not use keep what an earlier step wrote there, which was
checked then; a step that ran out of slots is gathered region by region instead (:meth:`gather`),
and the next gets room for all of them.
"""

from __future__ import annotations

import itertools
import operator
import threading
from itertools import islice, repeat

import torch

from .compat import foreach_copy_, foreach_norm, foreach_square_
from .finite import F32_MAX, as_float32, extrema, stored
from .shards import PLAIN

STRICT, GRAD, NAN_ONLY, LOOSE = 0, 1, 2, 3
REGIONS = (STRICT, GRAD, NAN_ONLY, LOOSE)  # their order in a row
RELU_OF = 4  # a ref's region code plus this: the ReLU of that slot (see Slots.relu)
FLOAT32, FLOAT64, COMPLEX64 = torch.float32, torch.float64, torch.complex64
# the dtypes whose norm is taken in their own precision (see _norm_dtype)
_WIDE = frozenset((FLOAT64, torch.complex32, COMPLEX64, torch.complex128))
_DTYPE = operator.attrgetter("dtype")
_F32 = frozenset((FLOAT32,))
_IS_CPU = operator.attrgetter("is_cpu")
_CONTIGUOUS = torch.Tensor.is_contiguous
_FLAT = operator.methodcaller("view", -1)
_DATA_PTR = torch.Tensor.data_ptr


class _Region:
    """One region's slots: a part of the :class:`Slots` vector, with its one-element views."""

    def __init__(self, data: torch.Tensor, views: tuple, pairs: tuple):
        self.size = data.numel()
        self.data = data
        # views made once, so a statistic costs no allocation: each slot, each adjacent pair
        self.views, self.pairs = views, pairs
        # Slot numbers come from a counter: taking one is atomic under the GIL, so hooks firing
        # from several threads need no lock on the per-call path; a new step, a new counter
        # (see Slots.start_step).
        self.take = itertools.count().__next__
        self.extra: list[torch.Tensor] = []  # what did not fit, numbered on from ``size``
        self._prefix = data

    def used(self) -> int:
        """How many slots were handed out (overflow included)."""
        # the counter's next number, read without taking it: its repr is "count(N)"
        return int(repr(self.take.__self__)[6:-1])

    def prefix(self) -> torch.Tensor:
        """The slots handed out so far (and any overflow) as one vector."""
        used = min(self.used(), self.size)
        if self._prefix.numel() != used:  # the count rarely changes between steps
            self._prefix = self.data.narrow(0, 0, used)
        if self.extra:
            return torch.cat([self._prefix, torch.stack(self.extra).float()])
        return self._prefix


class Slots:
    """Preallocated float32 slots on one device, handed out in order during a step: one vector,
    ``sizes`` slots per region in row order."""

    def __init__(self, device: torch.device, n: int = 256, sizes: tuple[int, ...] | None = None):
        self.device = device
        self._cpu = device.type == "cpu"  # (``t.is_cpu`` builds no device object per check)
        self._lock = threading.Lock()  # for the overflow list only
        self._build(sizes or (n,) * len(REGIONS))
        # default-sized slots are refitted to what the first step used (see start_step)
        self.fitting = sizes is None

    def _build(self, sizes: tuple[int, ...]) -> None:
        with torch.inference_mode(False):  # (built in an inference-mode step, later written by
            # training steps, which may not write an inference tensor)
            self.data = torch.zeros(sum(sizes), dtype=FLOAT32, device=self.device)
        views = self.data.unbind(0)
        pairs = self.data.unfold(0, 2, 1).unbind(0) if self.data.numel() > 1 else ()
        self.starts: tuple[int, ...] = tuple(itertools.accumulate(sizes, initial=0))[:-1]
        self.ends = tuple(a + n for a, n in zip(self.starts, sizes))
        self.short = False  # this step asked for more slots than there are (see start_step)
        # this step takes entries the next may not: cleared as it starts, so that its row
        # holds none of them (the weight norms before the first update, recorder.grads)
        self.once = False
        self._regions = [_Region(self.data.narrow(0, at, size), views[at: at + size],
                                 pairs[at: at + size - 1])
                         for at, size in zip(self.starts, sizes)]
        self._sized = [r for r in self._regions if r.size]  # (what a new step resets)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def start_step(self) -> None:
        """Hand the slots out again from the first (the last step's values are in the ring);
        after a step that ran short, a new vector, with room in each short region for what
        it was asked plus a quarter."""
        fit = self.fitting and any(map(_Region.used, self._regions))
        if self.short or fit:
            if fit:  # the first step's row was gathered: each region sized to what it used
                # and a margin, so that a row, its copy and its checks touch a few cache lines,
                # not the default 4 KiB (a later step that needs more runs short once)
                self.fitting = False
                sizes = [u + u // 4 + 8 for u in map(_Region.used, self._regions)]
            else:
                sizes = [(w := r.size + len(r.extra)) + w // 4 if r.extra else r.size
                         for r in self._regions]
            self._build(tuple(sizes))
            return
        if self.once:
            self.once = False
            self.data.zero_()
        # A new counter per region. Overflow is only ever added with ``short`` set, and a
        # short step's successor is built anew above, so the overflow lists are empty here.
        count = itertools.count
        for r in self._sized:
            r.take = count().__next__

    def gather(self) -> list[torch.Tensor]:
        """Each region's entries so far (and any overflow) as one vector, in row order: the
        row of a step that ran short (hooks of other threads may still add entries; what they
        add after this is not part of the step's row)."""
        return [r.prefix() for r in self._regions]

    def row_pieces(self) -> tuple[list[torch.Tensor], tuple[int, ...], tuple[int, ...]]:
        """This step's part of a row, as (pieces in row order, start and end of each region in
        them): the whole vector, or, after running short, each region gathered (see
        :meth:`gather`)."""
        if not (self.short or self.fitting):
            return [self.data], self.starts, self.ends
        pieces = self.gather()
        ends = tuple(itertools.accumulate(p.numel() for p in pieces))
        return pieces, (0, *ends[:-1]), ends

    def region(self, code: int) -> torch.Tensor:
        """One region's entries so far (see :meth:`gather`)."""
        return self._regions[code].prefix()

    def zero(self, code: int) -> None:
        """Clear one region's slots (values a later, smaller step would not overwrite)."""
        self._regions[code].data.zero_()

    def value(self, ref: tuple[int, int]) -> torch.Tensor:
        code, k = ref
        r = self._regions[code]
        return r.views[k] if k < r.size else r.extra[k - r.size]

    def _put(self, code: int, values) -> list[tuple[int, int]]:
        """Refs for values computed outside the slots (another device or dtype, a step out of
        room, the small parameters' foreach norms): copied into free slots in one foreach op,
        the rest kept as overflow. No Python loop over the values: it runs for every small
        parameter at every step."""
        r = self._regions[code]
        n = len(values)
        if not n:
            return []
        # n consecutive slots: ``islice`` takes them from the region's counter in one C call,
        # which no other thread's hook can interleave with (it holds the GIL throughout)
        k = next(islice(r.take.__self__, n - 1, None)) - n + 1
        m = max(0, min(n, r.size - k))
        if m:
            foreach_copy_(list(r.views[k: k + m]), list(values[:m]))
        refs = list(zip(repeat(code), range(k, k + m)))
        if m < n:
            with self._lock:
                self.short = True
                for v in values[m:]:
                    refs.append((code, r.size + len(r.extra)))
                    r.extra.append(v.detach().to(self.device, FLOAT32).reshape(()))
        return refs

    @staticmethod
    def _one(r: _Region) -> int | None:
        k = r.take()
        return k if k < r.size else None

    # ------------------------------------------------------------------------------------------
    # reductions: ``t`` is detached by the caller; each returns refs. They run a dozen to a few
    # hundred times a step, so the usual case (float32, on this device, room left) comes first.

    def minmax(self, t: torch.Tensor, code: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """``torch.aminmax(t)``: NaN anywhere makes both NaN; +-Inf shows as the extreme."""
        if t.dtype is FLOAT32 and (t.is_cpu if self._cpu else t.device == self.device) \
                and not t.is_nested:
            r = self._regions[code]
            take = r.take
            k, k2 = take(), take()  # (two slots: this runs for every call's output)
            if k2 < r.size:
                views = r.views
                try:  # (``split_extrema`` inlined)
                    if self._cpu and ((n := t.numel()) >= _SPLIT
                                      or (n >= _SPLIT_STRIDED and not t.is_contiguous())):
                        torch.amin(t, dim=(), out=views[k])
                        torch.amax(t, dim=(), out=views[k2])
                    else:
                        torch.aminmax(t, out=(views[k], views[k2]))
                except NotImplementedError:  # a sparse tensor (a GCN's adjacency passed in)
                    _sparse_minmax(t, views[k], views[k2])  # (caught: no layout check to pay)
                except RuntimeError:  # no elements (an empty Poisson-sampled batch): finite
                    if t.numel():
                        raise
                    views[k].zero_()
                    views[k2].zero_()
                return (code, k), (code, k2)
            if k < r.size:  # a lone last slot: part of the row, so zeroed (it may be checked)
                r.views[k].zero_()
        pair = extrema(t)
        if pair[0].dtype is FLOAT64:  # (a float64 model's values beyond float32's range)
            pair = tuple(map(as_float32, pair))
        lo, hi = self._put(code, pair)
        return lo, hi

    def total(self, t: torch.Tensor, code: int) -> tuple[int, int]:
        """Sum in float32 (NaN and +-Inf survive it)."""
        if t.ndim and t.device == self.device and not t.is_nested:
            r = self._regions[code]
            k = self._one(r)
            if k is not None:
                try:
                    torch.sum(t, dim=tuple(range(t.ndim)), dtype=FLOAT32, out=r.views[k])
                except NotImplementedError:  # a sparse tensor: its values (implied zeros
                    torch.sum(stored(t), dtype=FLOAT32, out=r.views[k])  # are finite)
                return code, k
        return self._put(code, [torch.sum(stored(t), dtype=FLOAT32)])[0]

    def norm(self, t: torch.Tensor, code: int, square: bool = False) -> tuple[int, int]:
        """2-norm (or its square), accumulated in float32; float64 in float64 (torch refuses to
        narrow a norm), a complex tensor in its real precision."""
        dtype = _norm_dtype(t)
        if (dtype is FLOAT32 or t.dtype is COMPLEX64) and t.device == self.device:
            r = self._regions[code]
            k = self._one(r)
            if k is not None:
                out = r.views[k]
                torch.linalg.vector_norm(t, dtype=dtype, out=out)
                if square:
                    out.square_()
                return code, k
        n = torch.linalg.vector_norm(t, dtype=dtype)
        v = n.square() if square else n
        if n.dtype is FLOAT64:  # (finite in float64: finite in its slot; see as_float32)
            v = torch.where(n.isinf(), n, v.clamp(max=F32_MAX))
        return self._put(code, [v])[0]

    def sq_norm(self, t: torch.Tensor, code: int) -> tuple[int, int]:
        """Squared 2-norm in float32 (see :meth:`sq_norm_each`)."""
        return self.sq_norm_each((t,), code)[0]

    def sq_norm_each(self, tensors, code: int) -> list[tuple[int, int]]:
        """Squared 2-norm of each tensor, in float32: a dot product (twice as fast as
        ``vector_norm`` on CPU) for float32, an upcast norm for other dtypes (a half-precision
        dot would overflow). It runs over every gradient before every update, so the usual case
        (dense float32 tensors on this device) is told by C loops (see :meth:`sq_norm_flat`)."""
        if type(tensors) is not list:
            tensors = list(tensors)
        if _F32.issuperset(map(_DTYPE, tensors)) and self._here(tensors) \
                and all(map(_CONTIGUOUS, tensors)):
            return self.sq_norm_flat(list(map(_FLAT, tensors)), code)
        r = self._regions[code]
        take, size, views, device, cpu = r.take, r.size, r.views, self.device, self._cpu
        refs = []
        for t in tensors:
            if t.dtype is FLOAT32 and (t.is_cpu if cpu else t.device == device):
                k = take()
                if k < size:
                    flat = t.view(-1) if t.is_contiguous() else flat_view(t)
                    torch.dot(flat, flat, out=views[k])
                    refs.append((code, k))
                    continue
            refs.append(self.norm(t, code, square=True))
        return refs

    def sq_norm_dense(self, t: torch.Tensor, code: int) -> tuple[int, int] | None:
        """:meth:`sq_norm` of one dense contiguous float32 tensor on this device (the gradient
        entering a model's one output, once a step), else None: its usual case in one frame."""
        if t.dtype is FLOAT32 and (t.is_cpu if self._cpu else t.device == self.device) \
                and t.is_contiguous():
            return self.sq_norm_flat([t.view(-1)], code)[0]
        return None

    def sq_norm_flat(self, flats: list[torch.Tensor], code: int) -> list[tuple[int, int]]:
        """Squared 2-norms of flat float32 vectors on this device (see :class:`FlatViews`):
        one dot each, into its slot. (Dots made by ``map`` and copied into the slots in one
        foreach op run fewer bytecodes, but measured slower in a training step: a new 0-d
        tensor per dot and the copy; see docs/benchmarks.md, stop 36.)"""
        r = self._regions[code]
        take, size, views = r.take, r.size, r.views
        refs = []
        for flat in flats:
            k = take()
            if k >= size:
                refs.append(self.norm(flat, code, square=True))
                continue
            torch.dot(flat, flat, out=views[k])
            refs.append((code, k))
        return refs

    def _here(self, tensors: list[torch.Tensor]) -> bool:
        """Every tensor is on this device."""
        if self._cpu:
            return all(map(_IS_CPU, tensors))
        device = self.device
        return all(t.device == device for t in tensors)

    def sq_norms(self, tensors: list[torch.Tensor], code: int) -> list[tuple[int, int]]:
        """Squared 2-norms of many (small) tensors: three foreach ops in all (one norm each
        where some are float64 or complex, which a float32 norm refuses, and a norm in their
        own type would overflow the half-precision ones)."""
        if not _WIDE.isdisjoint(map(_DTYPE, tensors)):  # (a C loop: no call per tensor)
            return [self.norm(t, code, square=True) for t in tensors]
        norms = foreach_norm(tensors, FLOAT32)
        foreach_square_(norms)
        return self._put(code, norms)

    def relu(self, lo: tuple[int, int], hi: tuple[int, int], code: int):
        """ReLU of a (min, max) pair: the (min, max) of the ReLU of what they describe (ReLU
        is non-decreasing: NaN stays NaN, -Inf becomes 0, +Inf stays). Where the pair's own
        check covers what region ``code`` would check of its ReLU (a NaN or +Inf in the ReLU
        is one in the pair; a -Inf in the pair that the ReLU makes 0 only makes a must-be-
        finite pair fail sooner), no op runs: refs to the ReLU *of* the pair's slots, resolved
        when the row is decoded (one op fewer per ReLU: a kernel launch on CUDA; on CPU the
        saving is below what docs/benchmarks.md resolves)."""
        src = lo[0] % RELU_OF
        if lo[0] == hi[0] and (src == STRICT or src == code):
            return (src + RELU_OF, lo[1]), (src + RELU_OF, hi[1])
        return self._pair_op(lo, hi, code, relu=True)

    def copy_pair(self, lo: tuple[int, int], hi: tuple[int, int], code: int):
        """A (min, max) pair copied into region ``code`` (checked as that region is)."""
        return self._pair_op(lo, hi, code)

    def _pair_op(self, lo: tuple[int, int], hi: tuple[int, int], code: int, relu: bool = False):
        """A (min, max) pair copied (or its ReLU taken) into two new slots of region ``code``:
        one op when both pairs sit in adjacent slots (the usual case), else two. Every value
        lives on this device (``_put`` moves what it keeps)."""
        if lo[0] >= RELU_OF:  # the ReLU of slots: ReLU'd into place (ReLU of a ReLU is one)
            relu = True
            lo, hi = (lo[0] - RELU_OF, lo[1]), (hi[0] - RELU_OF, hi[1])
        r = self._regions[code]
        k, k2 = r.take(), r.take()
        values = None
        i, src = lo[1], self._regions[lo[0]]
        if k2 < r.size and k2 == k + 1 and hi[1] == i + 1 and hi[0] == lo[0] \
                and i + 1 < src.size:
            pairs = ((src.pairs[i], r.pairs[k]),)
        elif k2 < r.size:
            pairs = ((self.value(lo), r.views[k]), (self.value(hi), r.views[k2]))
        else:  # no room: computed aside, then kept as overflow
            if k < r.size:  # a lone last slot: part of the row, so zeroed (it may be checked)
                r.views[k].zero_()
            values = torch.empty(2, dtype=FLOAT32, device=self.device).unbind(0)
            pairs = ((self.value(lo), values[0]), (self.value(hi), values[1]))
        for a, out in pairs:
            if relu:
                torch.clamp_min(a, 0.0, out=out)
            else:
                out.copy_(a)
        if values is None:
            return (code, k), (code, k2)
        lo, hi = self._put(code, values)
        return lo, hi


class FlatViews:
    """Detached flat views of parameters, made once and reused while each parameter keeps its
    storage: the weights' norms after every update then cost one dot each and no allocation
    (a detach and a reshape per weight per step otherwise). A parameter whose data was replaced
    (``p.data = ...``, ``model.to()``, ``.half()``) moves its data pointer, and the views are
    made again; one that is not a plain float32 tensor on ``device`` whose elements fill one
    dense block (a DTensor shard, a strided slice, another dtype) is not viewed (``None``); a
    channels-last or transposed one is viewed in memory order (see :func:`flat_view`)."""

    __slots__ = ("params", "ptrs", "flats", "every", "plain")

    def __init__(self, params: list[torch.Tensor]):
        self.params = params
        self.ptrs: list[int] = []
        self.flats: list[torch.Tensor | None] = []
        self.every = False  # every parameter has its view
        self.plain = all(type(p) in PLAIN for p in params)  # (no DTensor: the usual case)

    def get(self, device: torch.device) -> list[torch.Tensor | None]:
        # (a subclass, a DTensor, is never viewed: its pointer is not asked for; otherwise
        # the pointers are read in one C loop, as this runs for every weight at every step)
        ptrs = list(map(_DATA_PTR, self.params)) if self.plain else \
            [p.data_ptr() if type(p) in PLAIN else 0 for p in self.params]
        if ptrs != self.ptrs:
            self.ptrs = ptrs
            self.flats = [flat_view(p.detach(), copy=False) if type(p) in PLAIN
                          and p.dtype is FLOAT32 and p.device == device else None
                          for p in self.params]
            # (never ``None in flats``: ``in`` compares each tensor with ``==``)
            self.every = all(f is not None for f in self.flats)
        return self.flats


def _sparse_minmax(t: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> None:
    """(min, max) of a sparse tensor's specified values into ``lo`` and ``hi`` (zeros when it
    specifies none: its implied zeros are finite)."""
    values = stored(t)
    if values.numel():
        torch.aminmax(values, out=(lo, hi))
    else:
        lo.zero_()
        hi.zero_()


def flat_view(t: torch.Tensor, copy: bool = True) -> torch.Tensor | None:
    """Every element of ``t`` as one flat vector, in memory order: a view where they fill one
    dense block (contiguous, channels-last, any permutation of a contiguous tensor), which a
    norm or a sum reads as it would the tensor; else a copy (``None`` without ``copy``)."""
    if t.is_contiguous():
        return t.view(-1)
    p = t.permute(sorted(range(t.ndim), key=t.stride, reverse=True))
    if p.is_contiguous():
        return p.view(-1)
    return t.reshape(-1) if copy else None


def split_extrema(t: torch.Tensor) -> bool:
    """Whether a float32 CPU tensor's min and max are cheaper as ``amin`` + ``amax`` than as one
    ``aminmax``. On CPU (torch 2.13, one thread) ``aminmax`` over a whole hot 2 MB activation
    takes 87 us where ``amin`` and ``amax`` take 27 us each, and 366 us against 31 + 31 on a
    channels-last one; its one dispatch wins below ~32k elements (~4k when not contiguous).
    On CUDA it is one kernel and is never split."""
    n = t.numel()
    return n >= _SPLIT or (n >= _SPLIT_STRIDED and not t.is_contiguous())


_SPLIT, _SPLIT_STRIDED = 32768, 4096  # (see split_extrema)


def _norm_dtype(t: torch.Tensor) -> torch.dtype | None:
    """The dtype a norm of ``t`` accumulates in: float32, or ``t``'s own precision (None) for
    float64 and complex tensors (their norm is real: float32 for complex64)."""
    return None if t.dtype is FLOAT64 or t.is_complex() else FLOAT32
