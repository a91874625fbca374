"""The step's one host read: four numbers on the device, computed from the step's ring row.

``[0 if every must-be-finite entry is finite else NaN, the sum of squares of the entries where
only NaN counts (NaN if one is), 0, the GradScaler's scale]``, filled by three device ops, read
by one ``tolist()`` in :mod:`recorder.cycle`, the only module that reads the host (under
torch.distributed, with the ranks' flags after it: see :mod:`recorder.ranks`).
"""

from __future__ import annotations

import torch

from .ring import RingBuffer


class Probe:
    """The probe vector of one device, reused by every step."""

    def __init__(self):
        self._probe: torch.Tensor | None = None
        self._views: tuple = ()  # (device, each entry)
        self._nan_only = False  # its NaN-only entry holds the last step's sum of squares
        self.scaled = False  # the last fill carries the GradScaler's scale

    def fill(self, ring: RingBuffer, full: torch.Tensor, row: torch.Tensor,
             device: torch.device, checked: int, start: int, n: int,
             scale: torch.Tensor | None) -> torch.Tensor:
        """The probe of a row on ``device`` (``full``: the whole row, ``row`` the ring's,
        which may be cut) whose first ``checked`` entries must be finite and whose ``n`` entries
        from ``start`` must not be NaN, with ``scale`` (a GradScaler's) when there is one."""
        probe = self._probe
        if probe is None or self._views[0] is not device:  # (new slots: the model moved)
            probe = self._probe = torch.zeros(4, dtype=torch.float32, device=device)
            self._views = (device, *probe.unbind(0))  # (``probe.device`` makes an object)
            self._nan_only = False
        _, finite, lo, _, scale_out = self._views
        # (entries that may hold +-Inf: only NaN counts, told by their sum of squares)
        if full is row:
            ring.check_row(checked, start, n, finite, lo)
        else:  # (a row the ring keeps cut: the whole one checked here)
            finite.copy_(full[:checked].mul(0).sum())
            if n:
                part = full[start: start + n]
                torch.dot(part, part, out=lo)
        if not n and self._nan_only:  # the last step had such entries, this one has none
            lo.zero_()
        self._nan_only = bool(n)
        self.scaled = scale is not None
        if scale is not None:
            scale_out.copy_(scale.reshape(()))
        return probe
