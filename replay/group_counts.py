"""A pole op on a count per class or per group the step made, 0 for a class or group with none.

Code counts over the batch and divides by the count in two ways, told apart by what it counted:

- per class of the batch's labels: class weights from the batch's own pixels, ``w = 1 /
  torch.bincount(target)`` (or ``histc``, or one-hot or soft labels summed over dim 0: a phase
  picker's inverse-frequency weights from ``y.sum((0, 2))``). A class no pixel of the batch
  holds counts 0, its weight is 1/0 and ``w / w.sum()`` inf/inf. No sample is to blame (the
  counts are per class, not per record), so the generic "skip the rows where it is 0" does not
  apply: count over the training set, smooth or floor the counts.
- per group, accumulated by hand: a mean per group, ``total = zeros(G).index_add(0, group, x)``
  and ``count = zeros(G).index_add(0, group, ones)`` (or ``scatter_add``, ``bincount``), then
  ``total / count``; or the row sums of a 0/1 matrix (an adjacency's degrees, an island cell's
  0). A group the batch holds no element of has a count of 0 and a mean of 0/0; an eps would
  make that group's term 0 in silence (a region's integral of 0 lets its intensity grow
  without bound): leave the empty groups out, or give every group members.
  Where the groups are the batch's own samples (one entry per record, no graph's nodes: a
  document's total tf-idf weight over its bag of words), a 0 is an empty record (an
  EmbeddingBag's empty bag), said as such rather than as a graph's isolated node.
- a mean per group or class written with a one-hot membership matrix, whatever it encodes
  (the labels or a sensitive attribute): ``(p[:, None] * onehot).sum(0) / onehot.sum(0)``, a
  group's positive rate under a demographic-parity penalty. The numerator is a total over the
  same membership, so the quotient is 0/0 at a group absent from the batch: no fixed weight
  from the training set applies, and a floor makes that group's mean 0 in silence: leave the
  empty groups out.

- a count per sample of a mask a comparison made that is 0 in every sample of the batch
  (``(trimap == 0.5).float().sum((1, 2, 3))`` over trimaps decoded as 128 / 255): no record is
  empty, the comparison selects nothing; the hint says to check it, not to floor the count.

:class:`GroupCounts` watches the ops (fed by :class:`~replay.lineage.Lineage`) for such counts,
as they are, converted, viewed or multiplied by a positive number, and for the first pole op
that went non-finite at a 0 of one; :func:`class_counts_hint` (labels) and
:func:`with_empty_groups` (groups) then say so.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from recorder.finite import zero_one
from recorder.samples import Samples

from .memo import TensorMarks
from .positive_counts import ADVICE as POSITIVES  # (a scene's objects: not a graph's rows)

# what the hint says the pole op took (a weight 1/count of a class absent from the batch
# multiplies that class's labels, 0 everywhere: no mask to blame after it)
PER_CLASS = "of a count per class (or bin) of the batch's labels"
# ops that count the values of integer data by class or bin
_COUNTS = {"bincount", "histc"}
# ops that accumulate values per group (``index_put`` only with ``accumulate=True``)
_ACCUMULATE = {"index_add", "index_add_", "scatter_add", "scatter_add_", "scatter_reduce",
               "scatter_reduce_", "bincount", "index_put", "index_put_"}
# ops that keep the counts as they are (a dtype conversion, a view, a copy)
_SAME = {"_to_copy", "to", "float", "clone", "alias", "view", "reshape", "_unsafe_view",
         "contiguous", "detach", "slice", "squeeze", "unsqueeze", "unsqueeze_", "expand"}
# ops that make a mask by comparing values
_COMPARISONS = {"eq", "ne", "lt", "le", "gt", "ge", "isclose", "logical_and", "logical_or"}
# ops with a pole at an operand of 0, and which operand that is
_POLES = {"reciprocal": 0, "div": 1, "rsqrt": 0, "log": 0, "log2": 0, "log10": 0}
_DIVISIONS = {"div", "reciprocal"}


class Count(NamedTuple):
    """What made a count: the op (``sum`` for a 0/1 matrix's row sums), and whether it counted
    the batch's labels by class."""

    op: str
    labels: bool
    per_class: bool = False  # a 0/1 tensor's sums per sample that keep another dim (a class's)


class Found(NamedTuple):
    pole: str  # aten.NAME: the pole op that went non-finite at a count of 0
    count: Count
    groups: list[int]  # the entries along the count's first dim that are 0
    mean: bool = False  # its numerator a total over a 0/1 membership matrix: a mean per group
    every: bool = False  # 0 at every entry: a mask a comparison made that selects nothing
    # one entry per sample of the batch, no graph's nodes: the groups are the records
    # themselves (a document's total weight over its bag of words)
    per_sample: bool = False


class GroupCounts:
    def __init__(self, learned=lambda t: t.requires_grad, where: Samples | None = None):
        self._made = TensorMarks()  # a Count per value the step counted
        self._where = where  # the batch's size and graph segments, where known
        self.found: Found | None = None
        self._learned = learned  # whether a tensor is on the model's graph (no label)
        # 0/1 membership matrices a count summed; values masked by one ("masked"), their
        # sums over the batch ("total")
        self._members = TensorMarks()
        self._compared = TensorMarks()  # masks a comparison made (trimap == 0.5), converted

    def compared(self, t: torch.Tensor) -> bool:
        """Whether a comparison made ``t`` (as it is, converted or viewed): a mask."""
        return bool(self._compared.get(t))

    def track(self, name: str, args, out) -> None:
        if self.found is not None or not args or not isinstance(out, torch.Tensor):
            return
        if name in _COMPARISONS or name.startswith("bitwise_") and out.dtype == torch.bool \
                or name in _SAME and self._compared.get(args[0]):
            self._compared.put(out, True)
        count = self._counted(name, args, out)
        if count is not None:
            self._made.put(out, count)
            if name == "sum" and count.op == "sum" and _over_batch(args):
                self._members.put(args[0], "member")
            return
        self._masked(name, args, out)
        at = _POLES.get(name.rstrip("_"))
        if at is None or len(args) <= at or not isinstance(x := args[at], torch.Tensor) \
                or (count := self._made.get(x)) is None:
            return
        try:
            hit = bool(((x == 0) & ~torch.isfinite(out)).any())
        except RuntimeError:  # (shapes that do not broadcast to the output)
            return
        if hit:
            # (the groups along the first dim: ``count[:, None]`` broadcast over features)
            groups = torch.nonzero((x == 0).reshape(x.shape[0], -1).any(1)).flatten().tolist() \
                if x.dim() else []
            mean = at == 1 and self._members.get(args[0]) == "total"
            every = x.dim() > 0 and len(groups) == x.shape[0] > 1 and not bool(x.any())
            self.found = Found(f"aten.{name}", count, groups, mean, every, self._per_sample(x))

    def _per_sample(self, x: torch.Tensor) -> bool:
        """``x``'s entries along dim 0 are the batch's samples, not a graph batch's nodes."""
        w = self._where
        return w is not None and w.size > 1 and x.dim() > 0 and x.shape[0] == w.size \
            and not w.per_node(x)

    def _masked(self, name: str, args, out) -> None:
        """Mark ``out`` when it multiplies by a membership matrix (``p[:, None] * onehot``) or
        sums such a product over the batch (dim 0: a total per group)."""
        marks = [self._members.get(a) for a in args[:2] if isinstance(a, torch.Tensor)]
        if name == "mul" and "member" in marks:
            self._members.put(out, "masked")
        elif name == "sum" and marks[:1] == ["masked"] and _over_batch(args):
            self._members.put(out, "total")

    def _counted(self, name: str, args, out) -> Count | None:
        """The count ``out`` is, if the op counted or carried one."""
        first = args[0]
        if name in _COUNTS:
            return Count(name, True)
        if self._label_sum(name, args, out):
            return Count("sum", True)
        if name == "sum" and len(args) > 1 and (_zero_one(first) or self._mask_of_none(first)):
            # (the row counts of a 0/1 matrix: a node's degree; of a (B, T, C) one over T:
            # each sample's active frames per speaker or class)
            return Count("sum", False, out.dim() >= 2 and out.numel() > out.shape[0])
        if name in _ACCUMULATE and (not name.startswith("index_put")
                                    or len(args) > 3 and args[3] is True):  # (accumulate=True)
            return Count(name.rstrip("_"), False)
        if name in _SAME and isinstance(first, torch.Tensor):
            return self._made.get(first)
        if name == "mul":
            return self._scaled(args)
        return None

    def _mask_of_none(self, x) -> bool:
        """``x`` is a mask a comparison made (bool, or converted to 0/1) over a batch, 0 at every
        entry: it selects nothing (``trimap == 0.5`` of a trimap decoded as 128 / 255), a
        count of none, unlike exp's values that underflowed to 0 (:func:`_zero_one`)."""
        return isinstance(x, torch.Tensor) and bool(self._compared.get(x)) and x.dim() >= 2 \
            and x.shape[0] > 1 and not bool(x.any())

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

    def _scaled(self, args) -> Count | None:
        """The count ``args`` multiply by a positive number (``3 * mass``: its 0 stays 0)."""
        t = [c for a in args[:2] if isinstance(a, torch.Tensor)
             and (c := self._made.get(a)) is not None]
        k = [a for a in args[:2] if isinstance(a, (int, float))
             or isinstance(a, torch.Tensor) and a.dim() == 0 and self._made.get(a) is None]
        return t[0] if len(t) == 1 and len(k) == 1 and bool(torch.as_tensor(k[0]) > 0) else None


def _over_batch(args) -> bool:
    """A ``sum`` op's ``args`` sum over dim 0 (the batch), keeping another dim."""
    return len(args) > 1 and 0 in ([args[1]] if isinstance(args[1], int) else args[1] or ())


def _zero_one(x) -> bool:
    """``x`` is a 0/1 matrix (an adjacency, a membership or mask matrix) or a 0/1 tensor of
    more dims (activity labels per sample, frame and speaker): its sums are counts. One with no
    1 at all is no evidence of one: Gaussian kernels whose exp underflowed to 0 in every entry
    (a kernel width of 0) are 0 everywhere too."""
    return isinstance(x, torch.Tensor) and x.dim() >= 2 and x.is_floating_point() \
        and x.shape[0] > 1 and zero_one(x) and bool((x == 1).any())


PER_SAMPLE_CLASS = (
    "the divisor is a count per sample and class: 0/1 labels summed over their positions or "
    "frames (a speaker's active frames in a chunk, a class's pixels in an image), 0 for a "
    "class absent from sample(s) {rows}. That is an ordinary record (a speaker who says "
    "nothing in that chunk, a class not in that image), not a degenerate one, so don't drop "
    "it: a weight negatives / positives or a mean over the positives taken per sample is "
    "infinite or 0/0 there; divide by count.clamp(min=1) (the positives' terms are 0 there "
    "anyway), compute such weights over the training set, or leave out the (sample, class) "
    "terms with no positive")


# a per-group accumulation whose groups are the batch's own rows (a graph batch's nodes, which
# name their graphs): a row that received nothing is a record's, not a group the batch lacks
EMPTY_ROWS = (
    "the divisor was accumulated per row by {op} (a count of what each row received: a "
    "node's incoming edges, summed over an edge list's receivers), and it is 0 at row(s) "
    "{groups}, rows of sample(s) {rows}: nothing was accumulated into them, so they are "
    "isolated nodes (an atom with no neighbour inside the cutoff: a one-atom cell whose "
    "neighbour search skipped its own periodic images, a cutoff shorter than the structure's "
    "shortest bond; a node no edge reaches). The record's neighbour list is to blame, not the "
    "batch's sampling: build it so every node has a neighbour (search the periodic images, "
    "widen the cutoff, keep the k nearest neighbours whatever their distance) or filter such "
    "graphs where the data is made; divide by count.clamp(min=1) only where 0 is the right "
    "mean of no neighbours")


def class_counts_hint(watch: GroupCounts | None, cause: str | None, hit) -> str | None:
    """The hint for ``hit`` when ``watch`` saw it take a count per class of 0; else None."""
    found = watch and watch.found
    if not found or not found.count.labels or cause != "invalid" or hit is None \
            or found.pole != hit.op or hit.rows or found.mean:
        return None  # (a count per sample, a graph's nodes under mean pooling: its record)
    return (f"{hit.op} {PER_CLASS} (bincount, histc, one-hot or soft labels summed over the "
            "batch), 0 for a class absent from the batch (no pixel, token or record of it in "
            "this step): no sample is to blame, and weights 1/count taken per batch are "
            "infinite there whenever a class is missing; count over the training set once "
            "(fixed class weights), smooth the counts (counts + 1) or floor them "
            "(counts.clamp_min(1))")


def with_empty_groups(hint: str | None, cause: str | None, hit,
                      watch: GroupCounts | None) -> str | None:
    """``hint``, for a division by a per-group accumulation that is 0 at some groups."""
    found = watch and watch.found
    if hint is None or not found or cause != "invalid" or hit is None or POSITIVES in hint \
            or hit.op.removeprefix("aten.").rstrip("_") not in _DIVISIONS:
        return hint
    op, groups = found.count.op, found.groups
    if found.mean and not hit.rows:
        return (f"{hint}; but here it divides a total per group by the group's count, both "
                "sums over the batch of a 0/1 membership matrix (one-hot groups or classes: a "
                "mean per group written by hand, a group's positive rate), and the count is 0 "
                f"at group(s) {groups[:8]}: no record of the batch has a 1 there (a group absent "
                "from the batch; under equalised odds, a group with no positive label). No "
                "sample is to blame, and a floor (count.clamp_min(1)) or an eps would make those groups' "
                "means 0 in silence (a penalty comparing the groups' means then pulls the "
                "others toward 0): leave the empty groups out of the term (count > 0), or make "
                "the sampler put members of every group in each batch")
    if op not in _ACCUMULATE and found.count[:2] != ("sum", False):
        return hint
    if found.count.per_class and hit.rows and hit.rows == groups:
        return f"{hint}; but here {PER_SAMPLE_CLASS.format(rows=groups[:8])}"
    if op == "sum" and hit.rows and hit.rows == groups and found.every:
        return f"{hint}; but here " + NO_SAMPLE_SELECTED
    if op == "sum" and hit.rows and hit.rows == groups:  # (its rows the batch's samples)
        return (f"{hint}; but here the divisor is each sample's sum of its 0/1 weights (a "
                f"count of its valid entries), 0 in sample(s) {groups[:8]}: they have no valid "
                "entry (an image none of whose keypoints is annotated, a sequence with every "
                "position masked), and an eps would drop their terms in silence: leave them "
                "out (count > 0) or filter them where the data is made, or divide by "
                "count.clamp(min=1) where 0 is the right mean of nothing")
    if op == "sum":
        return (f"{hint}; but here the divisor is the row sums of a 0/1 matrix (an adjacency's "
                f"degrees, a membership count), 0 at row(s) {groups[:8]}: those rows have no "
                "entry (an isolated node, a grid cell whose neighbours are all masked out: an "
                "island). No record is to blame, and an eps would drop those rows' terms in "
                "silence: give them a neighbour or leave them out (deg > 0), or divide by "
                "deg.clamp(min=1) where 0 is the right mean of no neighbours")
    if found.per_sample and hit.rows and hit.rows == groups:
        return f"{hint}; but here " + EMPTY_RECORDS.format(op=op, rows=groups[:8])
    if hit.rows and found.count.op != "bincount":
        # (the groups are rows of the batch: a graph batch's nodes, named by their graphs)
        return f"{hint}; but here " + EMPTY_ROWS.format(op=op, groups=groups[:8], rows=hit.rows[:8])
    return (f"{hint}; but here the divisor was accumulated per group by {op} (a count or total "
            f"per group, a mean written by hand), and it is 0 at group(s) {groups[:8]}: no "
            "element of the batch fell in them (a region with no background point, a class "
            "absent from the batch). No record is to blame, and an eps would make those "
            "groups' terms 0 in silence: leave the empty groups out (count > 0), or make "
            "the sampler put members of every group in each batch")


# a per-group accumulation with one group per sample: a record that received nothing is empty
EMPTY_RECORDS = (
    "the divisor was accumulated per sample by {op} (each record's total over its elements: "
    "a document's weights over its bag of words, a set's or segment's size), and it is 0 in "
    "sample(s) {rows}: nothing was accumulated into them, so those records are empty (a "
    "document none of whose words is in the vocabulary, an EmbeddingBag's empty bag: two "
    "equal offsets, a set with no element). Filter such records where the data is made (the "
    "dataset, the collate_fn), or divide by total.clamp_min(eps) where 0 is the right value "
    "of an empty record, as EmbeddingBag's own mode='mean' gives an empty bag 0")


# every sample's count of a comparison's mask is 0: no record is empty, the mask selects nothing
NO_SAMPLE_SELECTED = (
    "the divisor is each sample's count of a mask a comparison made, and it is 0 in every "
    "sample of the batch: the mask selects nothing anywhere, which reads as a comparison with "
    "a value the data does not hold (an exact == on floats decoded from 8-bit: a trimap's "
    "128 / 255 is 0.502, not 0.5; a label id or threshold of another encoding), not as empty "
    "records: check the mask's values (compare against the encoded value, or use a "
    "tolerance); a floor or an eps would make the loss 0 in silence")
