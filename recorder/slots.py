"""Where a step's statistics are computed: device reductions written into preallocated slots.

Every statistic the recorder takes (an output's min and max, an input's sum, a gradient's
squared norm) is a 0-d float32 tensor on the model's device. Allocating each one costs more than
the allocation itself: on CPU, small tensors that live until the step closes fragment glibc's
heap, so the training step's own large buffers stop reusing freed memory, land on fresh pages
and page-fault (CNN benchmark: ~1,500 extra faults per step, +4 ms in the model's own backward
kernels). So the reductions write with ``out=`` into views of one preallocated vector, handed
out in order each step; only what ``out=`` cannot take (another device, ``aminmax`` of a
non-float32 tensor) or a step that ran out of slots allocates.
"""

from __future__ import annotations

import threading

import torch

FLOAT32, FLOAT64 = torch.float32, torch.float64


class Slots:
    """0-d float32 tensors on one device, handed out in order during a step."""

    def __init__(self, device: torch.device, n: int = 256):
        self.device = device
        self._lock = threading.Lock()  # hooks may fire from several threads
        self._alloc(n)
        self.used = 0
        self.wanted = 0  # what the step asked for, including what did not fit

    @property
    def short(self) -> bool:
        """This step asked for more slots than there are (the next one will have them)."""
        return self.wanted > len(self.views)

    def _alloc(self, n: int) -> None:
        self.data = torch.zeros(n, dtype=FLOAT32, device=self.device)
        self.views = self.data.unbind(0)  # made once: a view per statistic is no allocation

    def start_step(self) -> None:
        """Hand the slots out again from the first (the last step's values are in the ring)."""
        if self.short:
            self._alloc(max(2 * len(self.views), self.wanted + self.wanted // 4))
        self.used = self.wanted = 0

    def take(self, n: int) -> int | None:
        """Index of ``n`` consecutive free slots, or None when the step has used them all."""
        with self._lock:
            self.wanted += n
            k = self.used
            if k + n > len(self.views):
                return None
            self.used = k + n
        return k

    # ------------------------------------------------------------------------------------------
    # reductions: ``t`` is detached by the caller

    def minmax(self, t: torch.Tensor):
        """``torch.aminmax(t)``: NaN anywhere makes both NaN; +-Inf shows as the extreme."""
        if t.dtype is FLOAT32 and t.device == self.device:
            k = self.take(2)
            if k is not None:
                views = self.views
                return torch.aminmax(t, out=(views[k], views[k + 1]))
        return torch.aminmax(t)

    def total(self, t: torch.Tensor) -> torch.Tensor:
        """Sum in float32 (NaN and +-Inf survive it)."""
        if t.ndim and t.device == self.device:
            k = self.take(1)
            if k is not None:
                return torch.sum(t, dim=tuple(range(t.ndim)), dtype=FLOAT32, out=self.views[k])
        return torch.sum(t, dtype=FLOAT32)

    def norm(self, t: torch.Tensor) -> torch.Tensor:
        """2-norm, accumulated in float32 (float64 in float64: torch refuses to narrow)."""
        if t.dtype is FLOAT64:
            return torch.linalg.vector_norm(t).float()
        if t.device == self.device:
            k = self.take(1)
            if k is not None:
                return torch.linalg.vector_norm(t, dtype=FLOAT32, out=self.views[k])
        return torch.linalg.vector_norm(t, dtype=FLOAT32)

    def sq_norm(self, t: torch.Tensor) -> torch.Tensor:
        """Squared 2-norm in float32: a dot product (twice as fast as ``vector_norm`` on CPU)
        for float32, an upcast norm for other dtypes (a half-precision dot would overflow)."""
        if t.dtype is FLOAT32:
            flat = t.reshape(-1)
            if t.device == self.device:
                k = self.take(1)
                if k is not None:
                    return torch.dot(flat, flat, out=self.views[k])
            return torch.dot(flat, flat)
        return self.norm(t).square_()

    def relu(self, lo: torch.Tensor, hi: torch.Tensor):
        """ReLU of a (min, max) pair: the (min, max) of the ReLU of what they describe."""
        if lo.device == self.device:
            k = self.take(2)
            if k is not None:
                views = self.views
                return (torch.clamp_min(lo, 0.0, out=views[k]),
                        torch.clamp_min(hi, 0.0, out=views[k + 1]))
        return lo.clamp_min(0.0), hi.clamp_min(0.0)

    def sq_norms(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Squared 2-norms of many (small) tensors: one foreach call."""
        wide = any(t.dtype is FLOAT64 for t in tensors)
        norms = torch._foreach_norm(tensors, 2, dtype=None if wide else FLOAT32)
        n = len(norms)
        k = self.take(n) if norms[0].device == self.device else None
        if k is not None:
            try:
                torch.stack(norms, out=self.data.narrow(0, k, n)).square_()
                return list(self.views[k:k + n])
            except RuntimeError:  # spread over devices
                pass
        return [t.float().square() for t in norms]
