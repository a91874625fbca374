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

A statistic is named by a ref ``(region, index)``. Closing the step concatenates the used part
of each region, in that order, into the next ring row (one device op) and checks the row's
first ``STRICT`` (+ ``GRAD``) entries with one more (:meth:`recorder.ring.RingBuffer.reserve`
and ``probe_finite``).
"""

from __future__ import annotations

import threading

import torch

STRICT, GRAD, NAN_ONLY, LOOSE = 0, 1, 2, 3
REGIONS = (STRICT, GRAD, NAN_ONLY, LOOSE)  # their order in a row
FLOAT32, FLOAT64 = torch.float32, torch.float64


class _Region:
    def __init__(self, device: torch.device, n: int):
        self.data = torch.zeros(n, dtype=FLOAT32, device=device)
        self.views = self.data.unbind(0)  # made once: a view per statistic is no allocation
        self.used = 0
        self.wanted = 0  # asked for this step, including what did not fit
        # Once a request does not fit, the region is sealed for the step: what comes after
        # is kept as separate 0-d tensors, numbered on from ``used``.
        self.sealed = False
        self.extra: list[torch.Tensor] = []
        self._prefix = self.data

    def prefix(self) -> torch.Tensor:
        """The used slots (and any overflow) as one vector."""
        if self._prefix.numel() != self.used:  # the count rarely changes between steps
            self._prefix = self.data.narrow(0, 0, self.used)
        if self.extra:
            return torch.cat([self._prefix, torch.stack(self.extra).float()])
        return self._prefix


class Slots:
    """Preallocated float32 slots on one device, handed out in order during a step."""

    def __init__(self, device: torch.device, n: int = 256):
        self.device = device
        self._lock = threading.Lock()  # hooks may fire from several threads
        self._regions = [_Region(device, n) for _ in REGIONS]

    @property
    def short(self) -> bool:
        """This step asked for more slots than there are (the next one will have them)."""
        return any(r.wanted > len(r.views) for r in self._regions)

    def start_step(self) -> None:
        """Hand the slots out again from the first (the last step's values are in the ring);
        a region that ran short gets room for what it was asked plus a quarter."""
        for code, r in enumerate(self._regions):
            if r.wanted > len(r.views):
                r = self._regions[code] = _Region(self.device, r.wanted + r.wanted // 4)
            r.used = r.wanted = 0
            r.sealed = False
            r.extra = []

    def lengths(self) -> tuple[int, ...]:
        """Entries per region this step, in row order."""
        return tuple(r.used + len(r.extra) for r in self._regions)

    def gather(self) -> list[torch.Tensor]:
        """Each non-empty region's entries as one vector, in row order."""
        return [r.prefix() for r in self._regions if r.used or r.extra]

    def value(self, ref: tuple[int, int]) -> torch.Tensor:
        code, k = ref
        r = self._regions[code]
        return r.views[k] if k < r.used else r.extra[k - r.used]

    def _take(self, code: int, n: int) -> int | None:
        r = self._regions[code]
        with self._lock:
            r.wanted += n
            k = r.used
            if r.sealed or k + n > len(r.views):
                r.sealed = True
                return None
            r.used = k + n
        return k

    def _put(self, code: int, values) -> list[tuple[int, int]]:
        """Refs for values computed outside the slots (another device or dtype, or no room):
        copied into free slots, else kept as overflow."""
        r = self._regions[code]
        n = len(values)
        k = self._take(code, n) if values[0].device == self.device else None
        if k is not None:
            for j, v in enumerate(values):
                r.views[k + j].copy_(v)
            return [(code, k + j) for j in range(n)]
        with self._lock:
            r.sealed = True
            base = r.used + len(r.extra)
            r.extra.extend(v.to(self.device, FLOAT32) for v in values)
        return [(code, base + j) for j in range(n)]

    # ------------------------------------------------------------------------------------------
    # reductions: ``t`` is detached by the caller; each returns refs

    def minmax(self, t: torch.Tensor, code: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """``torch.aminmax(t)``: NaN anywhere makes both NaN; +-Inf shows as the extreme."""
        if t.dtype is FLOAT32 and t.device == self.device:
            k = self._take(code, 2)
            if k is not None:
                views = self._regions[code].views
                torch.aminmax(t, out=(views[k], views[k + 1]))
                return (code, k), (code, k + 1)
        lo, hi = self._put(code, torch.aminmax(t))
        return lo, hi

    def total(self, t: torch.Tensor, code: int) -> tuple[int, int]:
        """Sum in float32 (NaN and +-Inf survive it)."""
        if t.ndim and t.device == self.device:
            k = self._take(code, 1)
            if k is not None:
                torch.sum(t, dim=tuple(range(t.ndim)), dtype=FLOAT32,
                          out=self._regions[code].views[k])
                return code, k
        return self._put(code, [torch.sum(t, dtype=FLOAT32)])[0]

    def norm(self, t: torch.Tensor, code: int, square: bool = False) -> tuple[int, int]:
        """2-norm (or its square), accumulated in float32; float64 in float64 (torch refuses to
        narrow a norm)."""
        if t.dtype is not FLOAT64 and t.device == self.device:
            k = self._take(code, 1)
            if k is not None:
                out = self._regions[code].views[k]
                torch.linalg.vector_norm(t, dtype=FLOAT32, out=out)
                if square:
                    out.square_()
                return code, k
        n = torch.linalg.vector_norm(t, dtype=None if t.dtype is FLOAT64 else FLOAT32)
        return self._put(code, [n.square() if square else n])[0]

    def sq_norm(self, t: torch.Tensor, code: int) -> tuple[int, int]:
        """Squared 2-norm in float32: a dot product (twice as fast as ``vector_norm`` on CPU)
        for float32, an upcast norm for other dtypes (a half-precision dot would overflow)."""
        if t.dtype is FLOAT32 and t.device == self.device:
            k = self._take(code, 1)
            if k is not None:
                flat = t.reshape(-1)
                torch.dot(flat, flat, out=self._regions[code].views[k])
                return code, k
        return self.norm(t, code, square=True)

    def sq_norms(self, tensors: list[torch.Tensor], code: int) -> list[tuple[int, int]]:
        """Squared 2-norms of many (small) tensors: one foreach call."""
        wide = any(t.dtype is FLOAT64 for t in tensors)
        norms = torch._foreach_norm(tensors, 2, dtype=None if wide else FLOAT32)
        n = len(norms)
        k = self._take(code, n) if norms[0].device == self.device else None
        if k is not None:
            try:
                out = self._regions[code].data.narrow(0, k, n)
                torch.stack(norms, out=out).square_()
                return [(code, k + j) for j in range(n)]
            except RuntimeError:  # spread over devices: through _put below
                pass
        return self._put(code, [t.float().square() for t in norms])

    def relu(self, lo: tuple[int, int], hi: tuple[int, int], code: int):
        """ReLU of a (min, max) pair: the (min, max) of the ReLU of what they describe."""
        a, b = self.value(lo), self.value(hi)
        if a.device == self.device:
            k = self._take(code, 2)
            if k is not None:
                views = self._regions[code].views
                torch.clamp_min(a, 0.0, out=views[k])
                torch.clamp_min(b, 0.0, out=views[k + 1])
                return (code, k), (code, k + 1)
        lo, hi = self._put(code, [a.clamp_min(0.0), b.clamp_min(0.0)])
        return lo, hi
