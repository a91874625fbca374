"""A pole op on a count per class (or bin) of the batch's labels, 0 for a class absent.

Class weights from the batch's own pixels, ``w = 1 / torch.bincount(target)``: a class no
pixel of the batch holds counts 0, its weight is 1/0 and a normalisation ``w / w.sum()``
inf/inf. No sample is to blame (the counts are per class, not per record), so the generic
"skip the rows where it is 0" does not apply. :class:`ClassCounts` watches the ops of the
origin's call (fed by :class:`~replay.lineage.Lineage`) for the outputs of ``bincount`` and
``histc``, as they are or converted (``.float()``), and the first pole op that went
non-finite at a 0 of one; :func:`class_counts_hint` then names the count, where the op's
non-finite values are in no sample's rows (a per-graph node count under mean pooling is one
per sample: that record's).
"""

from __future__ import annotations

import torch

from .memo import TensorSet

# ops that count the values of integer data by class or bin
_COUNTS = {"bincount", "histc"}
# ops that keep the counts as they are (a dtype conversion, a view, a copy)
_SAME = {"_to_copy", "to", "clone", "alias", "view", "reshape", "_unsafe_view", "contiguous",
         "detach", "slice", "unsqueeze"}
# ops with a pole at an operand of 0, and which operand that is
_POLES = {"reciprocal": 0, "div": 1, "rsqrt": 0, "log": 0, "log2": 0, "log10": 0}


class ClassCounts:
    def __init__(self):
        self.op: str | None = None  # the pole op (aten.NAME) that took a count of 0
        self._counts = TensorSet()

    def track(self, name: str, args, out) -> None:
        name = name.split(".")[0]
        if self.op is not None or not isinstance(out, torch.Tensor) or not args:
            return
        if name in _COUNTS or (name in _SAME and isinstance(args[0], torch.Tensor)
                               and args[0] in self._counts):
            self._counts.add(out)
            return
        at = _POLES.get(name)
        if at is None or len(args) <= at or not isinstance(x := args[at], torch.Tensor) \
                or x not in self._counts:
            return
        try:
            hit = bool(((x == 0) & ~torch.isfinite(out)).any())
        except RuntimeError:  # (shapes that do not broadcast to the output)
            return
        if hit:
            self.op = f"aten.{name}"


def class_counts_hint(watch: ClassCounts | None, cause: str | None, hit) -> str | None:
    """The hint for ``hit`` when ``watch`` saw it take a count of 0; else None."""
    if watch is None or cause != "invalid" or hit is None or watch.op != hit.op or hit.rows:
        return None  # (a count per sample, a graph's nodes under mean pooling: its record)
    return (f"{hit.op} of a count per class (or bin) of the batch's labels (bincount, "
            "histc), 0 for a class absent from the batch (no pixel, token or record of it in "
            "this step): no sample is to blame, and weights 1/count taken per batch are "
            "infinite there whenever a class is missing; count over the training set once "
            "(fixed class weights), smooth the counts (counts + 1) or floor them "
            "(counts.clamp_min(1))")
