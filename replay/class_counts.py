"""A pole op on a count per class (or bin) of the batch's labels, 0 for a class absent.

Class weights from the batch's own pixels, ``w = 1 / torch.bincount(target)``: a class no
pixel of the batch holds counts 0, its weight is 1/0 and a normalisation ``w / w.sum()``
inf/inf. No sample is to blame (the counts are per class, not per record), so the generic
"skip the rows where it is 0" does not apply. :class:`ClassCounts` watches the ops of the
origin's call (fed by :class:`~replay.lineage.Lineage`) for the outputs of ``bincount`` and
``histc``, as they are or converted (``.float()``), for one-hot or soft labels (values in
[0, 1], off the autograd graph) summed over the batch's dim 0 per class (a phase picker's
inverse-frequency weights from ``y.sum((0, 2))``), and their positive multiples, and the
first pole op that went
non-finite at a 0 of one; :func:`class_counts_hint` then names the count, where the op's
non-finite values are in no sample's rows (a per-graph node count under mean pooling is one
per sample: that record's).
"""

from __future__ import annotations

import torch

from .memo import TensorSet

# what the hint says the pole op took (a weight 1/count of a class absent from the batch
# multiplies that class's labels, 0 everywhere: no mask to blame after it)
PER_CLASS = "of a count per class (or bin) of the batch's labels"
# ops that count the values of integer data by class or bin
_COUNTS = {"bincount", "histc"}
# ops that keep the counts as they are (a dtype conversion, a view, a copy)
_SAME = {"_to_copy", "to", "clone", "alias", "view", "reshape", "_unsafe_view", "contiguous",
         "detach", "slice", "unsqueeze"}
# ops with a pole at an operand of 0, and which operand that is
_POLES = {"reciprocal": 0, "div": 1, "rsqrt": 0, "log": 0, "log2": 0, "log10": 0}


class ClassCounts:
    def __init__(self, learned=lambda t: t.requires_grad):
        self.op: str | None = None  # the pole op (aten.NAME) that took a count of 0
        self._counts = TensorSet()
        self._learned = learned  # whether a tensor is on the model's graph (no label)

    def track(self, name: str, args, out) -> None:
        name = name.split(".")[0]
        if self.op is not None or not isinstance(out, torch.Tensor) or not args:
            return
        if name in _COUNTS or (name in _SAME and isinstance(args[0], torch.Tensor)
                               and args[0] in self._counts) or self._label_sum(name, args, out) \
                or (name == "mul" and self._scaled(args)):
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

    def _label_sum(self, name: str, args, out) -> bool:
        """``args`` sum labels over dim 0 and keep their class dim: values in [0, 1], not
        learned, that sum to at most 1 over a kept dim, 1 on average (one-hot or soft labels;
        not a mask's or an adjacency's 0/1, whose sums count steps or neighbours)."""
        if name != "sum" or len(args) < 2 or not isinstance(x := args[0], torch.Tensor) \
                or not x.is_floating_point() or x.dim() < 2 or x.shape[0] < 2 \
                or out.dim() < 1 or self._learned(x) or not bool(((x >= 0) & (x <= 1)).all()):
            return False
        dims = {d % x.dim() for d in ([args[1]] if isinstance(args[1], int) else args[1] or ())}
        kept = [x.sum(d) for d in range(x.dim()) if d not in dims]
        return 0 in dims and any(bool((s <= 1.001).all()) and float(s.mean()) > 0.5 for s in kept)

    def _scaled(self, args) -> bool:
        """``args`` multiply a count by a positive number (``3 * mass``: its 0 stays 0)."""
        t = [a for a in args[:2] if isinstance(a, torch.Tensor) and a in self._counts]
        k = [a for a in args[:2] if isinstance(a, (int, float))
             or isinstance(a, torch.Tensor) and a.dim() == 0 and a not in self._counts]
        return len(t) == 1 and len(k) == 1 and bool(torch.as_tensor(k[0]) > 0)


def class_counts_hint(watch: ClassCounts | None, cause: str | None, hit) -> str | None:
    """The hint for ``hit`` when ``watch`` saw it take a count of 0; else None."""
    if watch is None or cause != "invalid" or hit is None or watch.op != hit.op or hit.rows:
        return None  # (a count per sample, a graph's nodes under mean pooling: its record)
    return (f"{hit.op} {PER_CLASS} (bincount, "
            "histc, one-hot or soft labels summed over the batch), 0 for a class absent from the batch (no pixel, token or record of it in "
            "this step): no sample is to blame, and weights 1/count taken per batch are "
            "infinite there whenever a class is missing; count over the training set once "
            "(fixed class weights), smooth the counts (counts + 1) or floor them "
            "(counts.clamp_min(1))")
