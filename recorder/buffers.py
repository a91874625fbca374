"""The pre-step value of buffers that forwards change (BatchNorm statistics), kept on the device
so a bundle holds each buffer as the step found it.

A buffer is copied at the start of a step when it is new or changed since the last start (its
version counter moved), so static ones (masks) cost nothing; the copy of one that did not move
still holds its pre-step value. BatchNorm statistics, which change without moving the counter,
are copied every time, in one foreach call.
"""

from __future__ import annotations

import torch

from .compat import foreach_copy_, version_of


class BufferSnapshots:
    """Device copies of the model's buffers as of the last step start that changed them."""

    def __init__(self):
        self.clear()

    def bind(self, buffers: list[tuple[str, torch.Tensor]], norm_buffers: set[str]) -> None:
        """``buffers`` (name, tensor) of the model; ``norm_buffers``: those copied every step."""
        volatile = [(n, b) for n, b in buffers if n in norm_buffers and b.numel()]
        self.volatile = {n for n, _ in volatile}
        for n, b in volatile:
            self.copies[n] = torch.empty_like(b)
        self._volatile_pairs = ([self.copies[n] for n, _ in volatile],
                                [b for _, b in volatile]) if volatile else None
        self._steady = [(n, b) for n, b in buffers if n not in self.volatile]

    def clear(self) -> None:
        self.copies: dict[str, torch.Tensor] = {}
        self.volatile: set[str] = set()
        self._versions: dict[str, int | None] = {}
        self._volatile_pairs: tuple[list, list] | None = None
        self._steady: list[tuple[str, torch.Tensor]] = []

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.copies.values())

    def snapshot(self) -> None:
        """Copy what changed since the last step start."""
        if self._volatile_pairs:
            with torch.no_grad():
                foreach_copy_(*self._volatile_pairs)
        src, dst = [], []
        for name, b in self._steady:
            version = version_of(b)
            if b.numel() == 0 or (version is not None and self._versions.get(name) == version):
                continue
            copy = self.copies.get(name)
            if copy is None or copy.shape != b.shape or copy.dtype != b.dtype:
                copy = self.copies[name] = torch.empty_like(b)
            src.append(b)
            dst.append(copy)
            self._versions[name] = version
        if src:
            with torch.no_grad():
                foreach_copy_(dst, src)
