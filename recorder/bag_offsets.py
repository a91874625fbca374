"""An ``EmbeddingBag``'s ``offsets`` among a batch's 1-D tensors, and the bag (the sample)
each flat row of its ids or ``per_sample_weights`` is in (see :func:`recorder.samples.packed_in`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def bag_offsets(flat: list[tuple[tuple, torch.Tensor]]) -> list[tuple[int, int]]:
    """(i, j): flat tensor ``i`` (an ``EmbeddingBag``'s ids or ``per_sample_weights``) is
    bagged by the offsets ``flat[j]``, among 1-D ``(path, tensor)`` pairs. With several
    tables (DLRM's ``ids[k]``, ``offsets[k]``, ``weights[k]``; a dict per feature) each
    tensor takes the offsets whose path differs from its own in one place, the nearest in
    order (``emb(ids, offsets, weights)``), and that fit it (its last offset within it);
    a table's offsets do not bag another table's ids."""
    tensors = [t for _, t in flat]
    offsets = [j for j, t in enumerate(tensors) if are_offsets(t, tensors)]
    last = {j: int(tensors[j][-1]) for j in offsets}  # (host reads: the event's slow path)
    out = []
    for i, (path, t) in enumerate(flat):
        fit = [j for j in offsets if j != i and t.numel() > tensors[j].numel()
               and last[j] <= t.numel()]
        near = [j for j in fit if len(flat[j][0]) == len(path)
                and sum(a != b for a, b in zip(flat[j][0], path)) == 1] or fit
        if near:
            out.append((i, min(near, key=lambda j: (abs(j - i), j > i))))
    return out


@dataclass(frozen=True)
class Bags:
    """An ``EmbeddingBag``'s ``offsets``: bag ``b`` holds the flat rows from ``offsets[b]``
    to the next bag's start (``include_last_offset``'s final entry is the end)."""

    offsets: torch.Tensor

    def samples(self, rows: list[int]) -> list[int]:
        if not rows:
            return []
        return sorted(set(self.bag_of(torch.tensor(rows, dtype=self.offsets.dtype)).tolist()))

    def bag_of(self, rows: torch.Tensor) -> torch.Tensor:
        """The bag of each flat row in ``rows`` (on the offsets' device)."""
        o = self.offsets
        return torch.searchsorted(o, rows.to(o.device, o.dtype), right=True) - 1


def are_offsets(t: torch.Tensor, flat: list[torch.Tensor]) -> bool:
    """``t`` reads as the offsets of bags over a longer 1-D tensor beside it: integers from 0,
    never decreasing, each within that tensor (one host read, on the event's slow path)."""
    if t.dtype not in (torch.int64, torch.int32) or not t.numel():
        return False
    longest = max(u.numel() for u in flat)
    if longest <= t.numel():
        return False
    o = t.detach().cpu()
    return int(o[0]) == 0 and bool((o[1:] >= o[:-1]).all()) and int(o[-1]) <= longest
