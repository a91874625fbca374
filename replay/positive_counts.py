"""A loss's division by a count per sample of a 0/1 mask made of the data (the number of
positives: objects in a scene, foreground pixels), 0 in a record that has none.

CenterNet's and CenterPoint's heatmap focal loss divides by the number of objects; written per
scene, ``cells.sum((1, 2, 3)) / gt.eq(1).float().sum((1, 2, 3))``, a scene with no object (a
parking lot at night) makes its negatives' loss / 0 = +inf. :mod:`replay.data_divisor` calls
the records at a data divisor's 0 degenerate and says to drop them; but a record without
positives is a valid one (its negatives teach the model not to fire on background), so the fix
is the count's floor, or the batch's total. :class:`PositiveCounts` marks such counts (fed by
:class:`~replay.lineage.Lineage`): sums per sample of a comparison of real-valued targets; a
padding mask, or integer ids compared with the pad id, counts a record's length instead, whose
0 is an empty record. :func:`marked` picks the wording.
"""

from __future__ import annotations

import torch

from recorder.finite import zero_one

from . import data_divisor
from .memo import TensorMarks

ADVICE = (
    "; but its divisor there is a count per sample of a 0/1 mask made of the data (the "
    "number of positives: objects, foreground cells; a sum of gt.eq(1) or of a mask over each "
    "record), exactly 0 in the samples named, which have none (a scene or image without objects), "
    "while their dividend, the rest of their loss (the negatives, the background), is not 0: "
    "those records are valid and their negatives should train, so do not drop them or add an "
    "eps; floor the count as detectors do (num_pos.clamp_min(1), max(num_pos, 1)) or "
    "normalise by the batch's total count")
# ops that keep a count as it is (a dtype conversion, a view, a copy)
_COMPARE = {"eq", "ne", "gt", "ge", "lt", "le"}
_SAME = {"_to_copy", "to", "float", "clone", "alias", "view", "reshape", "_unsafe_view",
         "contiguous", "detach", "squeeze", "unsqueeze", "expand"}


class PositiveCounts:
    def __init__(self, learned):
        # "mask": a comparison of real-valued targets (gt.eq(1), iou > 0.5); "count": its 1s
        # per sample. (A padding mask given as data, or ids.ne(pad), counts a record's length:
        # a record with none is empty, data_divisor's degenerate one.)
        self._made = TensorMarks()
        self._learned = learned  # whether a tensor is on the model's graph

    def track(self, name: str, args, out) -> None:
        if not args or not isinstance(out, torch.Tensor) \
                or not isinstance(first := args[0], torch.Tensor):
            return
        if name in _SAME and (mark := self._made.get(first)):
            self._made.put(out, mark)
        elif name in _COMPARE and first.is_floating_point() and not self._learned(first):
            self._made.put(out, "mask")
        elif name in ("sum", "count_nonzero") and self._made.get(first) == "mask" \
                and self._per_sample(args, out) and _zero_one(first):
            self._made.put(out, "count")

    def made(self, t) -> bool:
        return isinstance(t, torch.Tensor) and self._made.get(t) == "count"

    @staticmethod
    def _per_sample(args, out: torch.Tensor) -> bool:
        """The reduction kept dim 0 (the samples) and summed some of the others."""
        x, dims = args[0], args[1] if len(args) > 1 else None
        if x.dim() < 2 or dims is None or out.dim() < 1 or out.shape[0] != x.shape[0]:
            return False
        dims = {d % x.dim() for d in ([dims] if isinstance(dims, int) else dims)}
        return bool(dims) and 0 not in dims


def _zero_one(x: torch.Tensor) -> bool:
    """A mask: every value 0 or 1 (bool, or a float of them), at least one 1 in the batch."""
    if x.dtype != torch.bool and not x.is_floating_point():
        return False
    return zero_one(x) and bool((x != 0).any())


def marked(lineage, op: str, ins: list[torch.Tensor], rows: list[int] | None, size: int,
           leaves: list | None = None) -> str:
    """The advice for a learned value over a data divisor 0 in some samples'
    (:func:`replay.data_divisor.marked`): this module's when that divisor is a count of
    positives, else ``data_divisor.ADVICE``; ``""`` when the op is no such division."""
    if not data_divisor.marked(lineage, op, ins, rows, size, leaves):
        return ""
    return ADVICE if len(ins) == 2 and lineage.positives.made(ins[1]) else data_divisor.ADVICE
