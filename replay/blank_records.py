"""Records whose real-valued data is all 0, where a division made 0/0 on their samples.

A scan or an image scaled by its own maximum, sum or norm inside the model or the loss
(``fixed / fixed.amax(dim=(1, 2, 3, 4), keepdim=True)``) is 0/0 when the record is blank: a
volume exported all zero, an image never written. The op's advice (an eps) would keep that
blank record in training; the hint adds which data the named samples lack, a real-valued
tensor of the batch all 0 in their rows while every other sample holds a non-zero value, so
the user can drop them where the data is made. (0/1 data is ``replay.empty_records``'.)
"""

from __future__ import annotations

from typing import Any

import torch

from .empty_records import batch_data
from .load import Step

_DIVIDING = {"aten.div", "aten.div_", "aten.reciprocal"}


def blank_records_hint(report: dict[str, Any], step: Step) -> None:
    """Append the real-valued tensors all 0 in exactly the samples of an ``invalid`` 0/0."""
    o, hint = report["origin"], report.get("hint") or ""
    rows, mb = o.get("samples") or [], o.get("micro_batch") or 0
    if report.get("cause") != "invalid" or o.get("op") not in _DIVIDING or not rows \
            or o.get("all_samples") or "0 by 0" not in hint or "empty records" in hint:
        return
    names = [name for name, t, d in batch_data(step, mb) if _blank_in(t, d, rows)]
    if names:
        which = ",".join(str(r) for r in rows)
        report["hint"] = (
            f"{hint}. Sample(s) {which} are blank records: {' and '.join(names)} "
            f"{'is' if len(names) == 1 else 'are'} all 0 in their rows while every other "
            "sample's holds values (a scan or image exported empty, a record never written), "
            "so a scale computed from them (their max, sum or norm) is the 0 divided here, and "
            "an eps would keep a blank record in training: drop or repair such records where "
            f"the data is made (the dataset, the collate_fn) (--try drop={which} re-runs the "
            "step without them)")


def _blank_in(t: torch.Tensor, d: int, rows: list[int]) -> bool:
    """``t`` is real-valued, not 0/1 data, all 0 in each of ``rows`` and non-zero somewhere
    in every other row."""
    if not t.is_floating_point() or max(rows) >= t.shape[d] or len(rows) >= t.shape[d]:
        return False
    flat = t.detach().movedim(d, 0).reshape(t.shape[d], -1)
    if bool(((flat == 0) | (flat == 1)).all()):
        return False
    kept = flat.ne(0).any(1)
    named = torch.zeros_like(kept)
    named[rows] = True
    return not bool(kept[named].any()) and bool(kept[~named].all())
