"""A batch tensor whose NaN lie in one contiguous run along its last dim (a time axis) in each
row that holds any, that row finite elsewhere: a gap of a recording (a seismometer's telemetry
dropout, a sensor's missing minutes) that the data pipeline filled with NaN when it merged or
resampled the segments, not a bad record nor a division of the pipeline."""

from __future__ import annotations

import torch

NAN_RUNS = (
    "the batch itself holds NaN, and {tensor} holds it in one contiguous run of its last dim "
    "(a time axis) in each row that has any, finite elsewhere: {where}: a gap in the recording "
    "that the data pipeline filled with NaN (a merge or a resample over missing samples: "
    "obspy's merge with fill_value=None, pandas' reindex); fill the gap with a finite value "
    "(0 after demeaning, an interpolation) and mask it if it matters, or drop the windows "
    "that hold one")


def nan_runs(t: torch.Tensor | None, d: int | None) -> str:
    """Where ``t``'s NaN runs lie, as text, when ``t`` is a signal of at least 16 positions,
    every non-finite value is NaN and each row along the last dim that holds one holds a
    single run of at least 2 positions that leaves part of the row finite ("" otherwise:
    scattered values, a whole row, an infinity, counts: non-negative integers)."""
    if t is None or d is None or not 2 <= t.dim() <= 3 or d == t.dim() - 1 \
            or t.shape[-1] < 16 or not t.is_floating_point():
        return ""  # (a signal (B, T) or (B, C, T): not an image's rows, nor a few features)
    nan = torch.isnan(t.detach())
    if not bool(nan.any()) or not bool(torch.isfinite(t[~nan]).all()):
        return ""
    rows = nan.movedim(d, 0).reshape(t.shape[d], -1, t.shape[-1])
    hit = rows.any(-1)
    count = rows.sum(-1)
    first = rows.int().argmax(-1)
    last = t.shape[-1] - 1 - rows.flip(-1).int().argmax(-1)
    span = last - first + 1
    if bool(((span != count) | (count < 2) | (count == t.shape[-1]))[hit].any()):
        return ""
    # (counts, every finite value a non-negative integer, are no recording: a cell's genes,
    # NaN in a few of them from a ``normalize_total`` of an empty cell written back)
    seen = t.detach()[~nan]
    if bool((seen >= 0).all()) and bool((seen == seen.round()).all()):
        return ""
    where = []
    for s in hit.any(1).nonzero().flatten().tolist()[:8]:
        i = hit[s].nonzero().flatten()
        lo, hi = int(first[s, i].min()), int(last[s, i].max())
        where.append(f"sample {s} at positions {lo}..{hi} of dim {t.dim() - 1}, in {i.numel()} "
                     f"of its {hit.shape[1]} rows")
    more = int(hit.any(1).sum()) - len(where)
    return "; ".join(where) + (f" (+{more} samples)" if more > 0 else "")
