"""A tensor's values read as the integers of their bits: what the replay compares bit for bit
between two re-runs (:mod:`replay.instrument`'s run digests, :mod:`replay.diverging_op`'s
fingerprints)."""

from __future__ import annotations

import torch

from recorder.finite import real_view

from .compat import holds_no_data

_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_integers(t: torch.Tensor) -> torch.Tensor | None:
    """``t``'s values flat, as integers of their width (a complex tensor's real and imaginary
    parts; bool as uint8); None for a tensor without plain storage to read (sparse, nested,
    meta, a subclass, autograd's efficient zero) or an empty one."""
    if t.layout is not torch.strided or t.is_meta or t.is_nested or not t.numel() \
            or type(t) not in (torch.Tensor, torch.nn.Parameter) or holds_no_data(t):
        return None
    x = real_view(t.detach()).contiguous().reshape(-1)
    if x.dtype == torch.bool:
        return x.to(torch.uint8)
    return x.view(_INTS[x.element_size()]) if x.element_size() in _INTS else None
