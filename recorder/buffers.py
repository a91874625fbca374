"""The pre-step value of buffers that forwards change (BatchNorm statistics), kept on the device
so a bundle holds each buffer as the step found it.

A buffer is copied at the start of a step when it is new or changed since the last start (its
version counter moved), so static ones (masks) cost nothing; the copy of one that did not move
still holds its pre-step value. BatchNorm statistics, which change without moving the counter,
are copied every time, in one foreach call.

Code written against ``.data`` changes a buffer without moving its counter too
(``self.embed.data.copy_(embed_avg / cluster_size)``, the EMA codebook of VQ-VAE code): at the
first step start after a training step, every buffer whose counter did not move is compared
with its copy (once, on the device) and copied; those that changed join the BatchNorm ones. The
comparison is read on the host at a later step start, after the step's own host read has
waited for it (no host sync of its own).
"""

from __future__ import annotations

import weakref

import torch

from .compat import foreach_copy_, version_of


class BufferSnapshots:
    """Device copies of the model's buffers as of the last step start that changed them."""

    def __init__(self):
        self.clear()

    def bind(self, homes: list[tuple[str, dict, str]], norm_buffers: set[str]) -> None:
        """``homes`` (name, buffer dict, key) of the model's buffers (the others are looked up
        at each step start: a forward may have put a new tensor there); ``norm_buffers``:
        those copied every step."""
        now = [(n, home[key]) for n, home, key in homes]
        self._steady = [(n, home, key) for (n, home, key), (_, b) in zip(homes, now)
                        if n not in norm_buffers or not b.numel()]
        self.volatile, self._volatile_items = set(), []
        self._make_volatile([(n, b) for n, b in now if n in norm_buffers and b.numel()])
        self._armed = True  # the comparison of the copies has yet to run

    def clear(self) -> None:
        self.copies: dict[str, torch.Tensor] = {}
        self.volatile: set[str] = set()
        # name -> (the tensor copied, weakly; its version then): a new tensor in the buffer's
        # place starts its own count, which may equal the old one's
        self._versions: dict[str, tuple[weakref.ref, int | None]] = {}
        self._volatile_items: list[tuple[str, torch.Tensor]] = []
        self._volatile_pairs: tuple[list, list] | None = None
        self._steady: list[tuple[str, torch.Tensor]] = []
        self._armed = False
        self._after_training = False
        self._compared: tuple[list[str], torch.Tensor, object] | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.copies.values())

    def snapshot(self, training: bool = True) -> None:
        """Copy what changed since the last step start (``training``: the step that starts
        is a training step, whose end may show buffers written through ``.data``)."""
        if self._compared is not None:
            self._learn()
        if self._volatile_pairs:
            with torch.no_grad():
                foreach_copy_(*self._volatile_pairs)
        compare = self._armed and self._after_training
        self._after_training = training
        src, dst, unmoved = [], [], []
        for name, home, key in self._steady:
            b = home.get(key)
            if b is None or b.numel() == 0:
                continue
            version = version_of(b)
            copy = self.copies.get(name)
            seen = self._versions.get(name)
            if version is not None and seen is not None and seen[0]() is b \
                    and seen[1] == version:
                if not compare or copy is None:
                    continue
                if copy.shape == b.shape and copy.dtype == b.dtype:  # (else copied anew)
                    unmoved.append((name, copy, b))
            if copy is None or copy.shape != b.shape or copy.dtype != b.dtype:
                copy = self.copies[name] = torch.empty_like(b)
            src.append(b)
            dst.append(copy)
            self._versions[name] = (weakref.ref(b), version)
        if compare:
            self._armed = False
            if unmoved:
                self._compare(unmoved)
        if src:
            with torch.no_grad():
                foreach_copy_(dst, src)

    def _compare(self, unmoved: list[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
        """Start the comparison of buffers whose counter did not move with their copies (before
        they are copied again); the host reads it once the device has got there."""
        try:
            with torch.no_grad():
                changed = torch.stack([(copy != b).any() for _, copy, b in unmoved])
        except RuntimeError:  # (a dtype without !=: those buffers keep the version rule)
            return
        done = None
        if changed.device.type == "cuda":
            host = changed.to("cpu", non_blocking=True)
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(changed.device))
        elif changed.device.type == "cpu":
            host = changed
        else:  # (no event to tell when a copy from this device is done: not compared)
            return
        self._compared = ([n for n, _, _ in unmoved], host, done)

    def _learn(self) -> None:
        """Read the comparison if the device got there; its changed buffers are copied at
        every step start from now on."""
        names, host, done = self._compared
        if done is not None and not done.query():
            return  # read at a later step start
        self._compared = None
        changed = {n for n, c in zip(names, host.tolist()) if c}
        if changed:
            moved = [(n, home[key]) for n, home, key in self._steady
                     if n in changed and home.get(key) is not None]
            self._steady = [h for h in self._steady if h[0] not in changed]
            self._make_volatile(moved)

    def _make_volatile(self, buffers: list[tuple[str, torch.Tensor]]) -> None:
        """Copy ``buffers`` at every step start too, in the same foreach call."""
        for n, b in buffers:
            self.volatile.add(n)
            copy = self.copies.get(n)
            if copy is None or copy.shape != b.shape or copy.dtype != b.dtype:
                self.copies[n] = torch.empty_like(b)
        items = self._volatile_items = self._volatile_items + buffers
        self._volatile_pairs = ([self.copies[n] for n, _ in items],
                                [b for _, b in items]) if items else None
