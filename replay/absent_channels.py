"""One-hot data with a channel empty in exactly the samples of a 0/0 division.

A per-sample, per-class Dice without a smooth term, ``2 * (p * t).sum(dims) / (p.sum(dims) +
t.sum(dims))`` over one-hot labels ``(B, C, ...)``, is 0/0 for a class absent from both the
record's label map and its prediction (a structure missing from a scan, warped atlas labels
lacking it too). The op's advice (an eps) is one fix; the hint adds which channel of which 0/1
tensor the named samples hold no entry of while every other sample holds one, so the user sees
the absent class and can smooth the ratio or leave absent classes out of the mean. A label map
of class indices ``(B, 1, ...)`` or ``(B, ...)``, which the loss one-hot encodes itself
(MONAI's ``to_onehot_y=True``: a generalized Dice over the foreground classes of a scan whose
labels are all background), names the class values instead.
"""

from __future__ import annotations

from typing import Any

import torch

from recorder.finite import zero_one

from .empty_records import batch_data
from .load import Step

_DIVIDING = {"aten.div", "aten.div_", "aten.reciprocal"}


def absent_channels_hint(report: dict[str, Any], step: Step) -> None:
    """Append the 0/1 tensors' channels empty in exactly the samples of an invalid 0/0."""
    o, hint = report["origin"], report.get("hint") or ""
    rows, mb = o.get("samples") or [], o.get("micro_batch") or 0
    if report.get("cause") != "invalid" or o.get("op") not in _DIVIDING or not rows \
            or o.get("all_samples") or "0 by 0" not in hint or " records: " in hint:
        return
    found = [(name, "channel", cs) for name, t, d in batch_data(step, mb)
             if (cs := _absent(t, d, rows))]
    found = found or [(name, "class", cs) for name, t, d in batch_data(step, mb)
                      if (cs := _absent_classes(t, d, rows))]
    if found:
        which = ",".join(str(r) for r in rows)
        said = " and ".join(f"{name} {what} {', '.join(map(str, cs))}"
                            for name, what, cs in found)
        kind = "0/1 data" if found[0][1] == "channel" else \
            "a label map of class indices, one-hot encoded in the loss"
        report["hint"] = (
            f"{hint}. Sample(s) {which} hold no entry of {said} ({kind}: a class or "
            "structure absent from the record) while every other sample holds some, so a "
            "per-class ratio over it (a Dice or IoU without a smooth term) is the 0/0 here: "
            "add a smooth term to both sides or leave classes absent from both the target and "
            f"the prediction out of the mean (--try drop={which} re-runs the step without them)")


def _absent(t: torch.Tensor, d: int, rows: list[int]) -> list[int]:
    """The channels (the dim after the samples') of 0/1 ``t`` with no entry in any of
    ``rows`` and some in every other row."""
    if t.dim() < d + 3 or max(rows) >= t.shape[d] or len(rows) >= t.shape[d] \
            or t.is_complex() or not zero_one(t):
        return []
    counts = t.detach().movedim(d, 0).reshape(t.shape[d], t.shape[d + 1], -1).ne(0).sum(2)
    named = torch.zeros(t.shape[d], dtype=torch.bool)
    named[rows] = True
    empty = (counts[named] == 0).all(0) & (counts[~named] > 0).all(0)
    return torch.nonzero(empty).flatten().tolist()


_MOST_CLASSES = 64  # (more distinct whole values are no label map: an integer image)


def _absent_classes(t: torch.Tensor, d: int, rows: list[int]) -> list[int]:
    """The class values of a label map of class indices ``t`` (whole numbers >= 0, at most
    :data:`_MOST_CLASSES` of them, more than two: a 0/1 map is :func:`_absent`'s; a spatial
    map, two dims or more after the samples') that no entry of ``rows`` holds and every other
    row does."""
    if t.dim() < d + 3 or max(rows) >= t.shape[d] or len(rows) >= t.shape[d] \
            or t.is_complex() or t.dtype == torch.bool:
        return []
    flat = t.detach().movedim(d, 0).reshape(t.shape[d], -1)
    if flat.is_floating_point() and not bool((flat == flat.round()).all()):
        return []
    values = torch.unique(flat)
    if len(values) <= 2 or len(values) > _MOST_CLASSES or bool(values[0] < 0):
        return []
    held = torch.stack([(flat == v).any(1) for v in values], 1)  # (samples, classes)
    named = torch.zeros(t.shape[d], dtype=torch.bool)
    named[rows] = True
    empty = ~held[named].any(0) & held[~named].all(0)
    return [int(v) for v in values[empty].tolist()]
