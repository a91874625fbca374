"""A batch tensor whose non-finite values fill whole slices of some samples (sample 6's
electrode 3 at every time step) while the rest of each such sample is finite: the mark of a
step of the data pipeline run per sample and per slice (a channel's standardisation by its own
zero std: a flat, disconnected electrode; a blank image channel), or of a record whose channel
was captured bad (a microphone that failed during a recording, written as NaN), which the batch
alone cannot tell apart: the hint gives both. Slices
of a few values each (at most ``COORDS``) along a longer dim are no channels but the points of
a set, each non-finite in every coordinate (a point cloud's point whose depth had no return,
back-projected to NaN; a keypoint not detected): :func:`slices_hint` says so."""

from __future__ import annotations

import torch

WHOLE_SLICES = (
    "the batch itself holds NaN/Inf, and {tensor} holds it in whole slices of its samples, "
    "each sample finite elsewhere: {where}, every value of each: a per-sample, per-slice step "
    "of the data pipeline made them (a standardisation of each channel by its own std, 0 for "
    "a flat channel: a disconnected electrode, a saturated sensor, a blank image channel; add "
    "an eps to the std, or interpolate or drop the channel), or the record holds that channel "
    "bad as it was captured (a microphone or sensor that failed during the take, its samples "
    "written as NaN): check the raw file; mask the channel, or drop the record")


# a slice of at most this many values, along a dim with more indices, is one point's coordinates
# (xy, xyz, xyzw; a box's 4 numbers), not a channel's series
COORDS = 4

WHOLE_POINTS = (
    "the batch itself holds NaN/Inf, and {tensor} holds it in whole points of its samples' "
    "sets, each sample finite elsewhere: {where}, every coordinate of each ({n} values): those "
    "points were never measured (a depth pixel with no return back-projected to NaN, a "
    "keypoint not detected, a sensor's dropout written as NaN), not a per-channel "
    "standardisation; drop them where the cloud is made (keep torch.isfinite(p).all(-1)) or "
    "resample the set to its size from its finite points, or give forward a mask that is 0 "
    "there and ignore them in every op (a weighted mean, a masked softmax)")


def slices_hint(t: torch.Tensor, d: int, tensor: str, where: str) -> str:
    """The hint for ``t``'s whole non-finite slices ``where`` (by :func:`whole_slices`):
    points of a set when each slice holds at most ``COORDS`` values along a dim longer than
    that (``(B, N, 3)``), else a channel's slices."""
    x = t.movedim(d, 0)
    n = x[0, 0].numel()
    if n <= COORDS and x.shape[1] > n:
        return WHOLE_POINTS.format(tensor=tensor, where=where, n=n)
    return WHOLE_SLICES.format(tensor=tensor, where=where)


def whole_slices(t: torch.Tensor | None, d: int | None) -> str:
    """``t``'s non-finite (sample, index of the dim after ``d``) slices as text when they are
    non-finite throughout and no sample is non-finite as a whole ("" otherwise: a record bad
    throughout, a few scattered values, a tensor of fewer than 3 dims, slices of one value
    each: a sorting instance's ``(B, N, 1)`` numbers, where one missing number is no slice)."""
    if t is None or d is None or t.dim() < 3 or not t.is_floating_point():
        return ""
    x = t.detach().movedim(d, 0)
    if x[0, 0].numel() < 2:
        return ""
    bad = ~torch.isfinite(x.reshape(x.shape[0], x.shape[1], -1))
    full, some = bad.all(-1), bad.any(-1)
    rows = some.any(1)
    if not bool(rows.any()) or bool((full != some).any()) or bool(full[rows].all(1).any()):
        return ""
    k = 1 if d == 0 else 0  # x's dim 1, as t numbers it
    pairs = full.nonzero().tolist()
    more = f" (+{len(pairs) - 8})" if len(pairs) > 8 else ""
    return ", ".join(f"sample {s} at index {i} of dim {k}" for s, i in pairs[:8]) + more
