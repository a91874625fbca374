"""``--try drop=`` of samples whose rows an input concatenates, one run of rows per sample,
given beside the per-sample row counts (stack mode's ``xyz_batch_cnt``, ``(B,)``) or their
boundaries (flash-attention's ``cu_seqlens``, ``(B + 1,)`` from 0): the dropped samples' rows
cut from every input with that many rows, the boundaries rebuilt for the samples kept."""

from __future__ import annotations

import torch

_INTS = (torch.int32, torch.int64)


def drop_segments(tensors: dict[str, torch.Tensor], keys: list[str], unrowed: set[str],
                  n: int, keep: torch.Tensor) -> list[str]:
    """The inputs ``keys`` (not cut otherwise) whose rows one of them counts or bounds per
    sample, without the rows of the samples not in ``keep``; the rows cut are of the
    ``unrowed`` ones only (no dim of theirs holds the samples: a time-major ``(T, B, F)``
    does). Returns the keys cut here (the counts themselves, one per sample, are left to the
    caller's per-sample cut)."""
    ts = {k: t for k in keys if isinstance(t := tensors.get(k), torch.Tensor)}
    rows = {t.shape[0] for k, t in ts.items() if k in unrowed and t.dim() and t.shape[0] != n}
    kept = torch.zeros(n, dtype=torch.bool)
    kept[keep] = True
    done: list[str] = []
    for k, b in ts.items():
        sizes = row_counts(b, n, rows) if k not in done else None
        if sizes is None:
            continue
        total = int(sizes.sum())
        flat = [j for j, t in ts.items() if j != k and j not in done and j in unrowed
                and t.dim() and t.shape[0] == total]
        cut = torch.repeat_interleave(kept, sizes)
        for j in flat:
            tensors[j] = ts[j][cut.to(ts[j].device)]
        if b.numel() == n + 1:
            ends = torch.cat([sizes.new_zeros(1), sizes[keep].cumsum(0)])
            tensors[k] = ends.to(b.device, b.dtype)
            done.append(k)
        done += flat
    return done


def row_counts(b: torch.Tensor, n: int, rows: set[int]) -> torch.Tensor | None:
    """The rows per sample that ``b`` gives (on the host) where it reads as counts (``n``
    integers, none negative) or boundaries (``n + 1``, from 0, never decreasing) of rows
    that another input has as many of in all (``rows``); else None."""
    if b.dim() != 1 or b.dtype not in _INTS or b.numel() not in (n, n + 1) or not n:
        return None
    c = b.detach().cpu().long()
    if c.numel() == n + 1:
        if int(c[0]) != 0 or bool((c.diff() < 0).any()):
            return None
        c = c.diff()
    return c if not bool((c < 0).any()) and int(c.sum()) in rows else None


def unmatched_bounds(named: dict[str, torch.Tensor], n: int) -> str | None:
    """The name of an input that reads as ``n + 1`` boundaries of rows per sample (integers
    from 0, never decreasing) while no input has as many rows as its last: a drop cannot cut
    the rows it bounds (kept elsewhere), nor leave the boundaries whole."""
    rows = {t.shape[0] for t in named.values() if isinstance(t, torch.Tensor) and t.dim()}
    for name, b in named.items():
        if isinstance(b, torch.Tensor) and b.dim() == 1 and b.dtype in _INTS \
                and b.numel() == n + 1 and n and int(b[-1]) > 0 and int(b[0]) == 0 \
                and not bool((b.diff() < 0).any()) and int(b[-1]) not in rows:
            return name
    return None
