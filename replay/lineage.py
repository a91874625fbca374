"""Where a value in a loss came from, for values that hold no batch dimension.

A detection or segmentation loss loops over the images: ``for i, t in enumerate(targets)``
over a list of per-image dicts of boxes, ``cls[i]`` of the model output. The tensors it makes
there (the matched boxes ``(P, 4)``, one image's loss) have no dimension of the batch's size,
so their rows say nothing of the samples; but each came from one image's entries. The
:class:`Lineage` follows that through the ops the op finder sees:

- ``samples``: a value made from element ``i`` of a per-sample list among the loss's arguments
  (a list as long as the batch), or from ``x[i]`` / ``x.unbind()`` along a batched tensor's
  samples, belongs to sample ``i``; an op's outputs belong to the samples of its inputs;
- ``learned``: a value made from the model's outputs on the autograd graph or from its
  parameters (or requiring grad, where the forward runs under autograd). An op none of whose
  inputs is learned, taking a sample's record, computed on the data alone (the targets,
  anchors, constants): a pole it hit is a degenerate record, not a weight;
- ``compared``: unless the loss takes that op of the model's output too, of the same shape,
  and compares the two in one op (a log-magnitude L1, ``|log|S| - log|Ŝ||``): the target is
  then 0 where the data is silent or zero-padded, a valid record in a domain with no floor.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from recorder.capture import tensor_leaves
from recorder.samples import Samples

from .crossed_cut_points import CrossedCutPoints
from .fold_coverage import FoldCoverage
from .group_counts import GroupCounts
from .log_sum_exp import LogSumExp
from .memo import TensorSet
from .positive_counts import PositiveCounts
from .power_limit import PowerAtZero
from .product_underflow import ProductUnderflow
from .quadratic_form import QuadraticForms
from .raw_pole import RawPole
from .signed_total import SignedTotals
from .wrapped_index import WrappedIndex

# ops that put their inputs side by side, each input's values in rows of their own
_JOINS = {"cat", "stack", "hstack", "vstack", "concat", "concatenate"}
# ops whose pole is at one of their inputs only: x * log(y)'s is at y
_POLE_INPUT = {"xlogy": -1, "special_xlog1py": -1}
# ops whose output's row i along the dim they take (their positional argument at the index
# given; -1 when absent) is no longer input row i: an order statistic or a running total
_REORDERS = {"sort": 1, "topk": 2, "kthvalue": 2, "cumsum": 1, "cumprod": 1, "cummax": 1,
             "cummin": 1, "logcumsumexp": 1}
# elementwise ops a loss may apply to the estimate and the target alike before comparing them
# (div: a ratio of two of their channels, a spectral index's (nir - red) / (nir + red))
_TRANSFORMS = {"log", "log2", "log10", "log1p", "sqrt", "rsqrt", "reciprocal", "pow", "div"}


def pole_inputs(op: str, ins: list[torch.Tensor]) -> list[torch.Tensor]:
    """The inputs of aten op ``op`` that decide whether it is computed on data alone: the
    one at its pole where it has one (a Beta's ``xlogy(a - 1, y)``: a learned concentration
    times the log of a target of exactly 0), else all of them."""
    i = _POLE_INPUT.get(op.removeprefix("aten.").split(".")[0].rstrip("_"))
    return ins[i:][:1] if i is not None and ins else ins


class Lineage:
    def __init__(self, where: Samples):
        self.where = where
        self._of: dict[int, tuple[weakref.ref, frozenset[int]]] = {}
        self.learned = TensorSet()
        self.raw: RawPole | None = None  # a pole op on the batch's own values (forward only)
        self.log_sum_exp = LogSumExp()  # a log of a sum of exps, written out
        # a pole op on a count per class or group (1 / bincount(target), total / count)
        self.counts = GroupCounts(self._learned, where)
        self.positives = PositiveCounts(self._learned)  # a count of a data mask's 1s per sample
        self.product = ProductUnderflow()  # a log of a product that underflowed
        self.power = PowerAtZero()  # (y ** 0 - 1) / 0: Box-Cox at lam = 0
        self.crossed = CrossedCutPoints()  # sigmoid(a) - sigmoid(b) < 0 (crossed thresholds)
        self.wrapped = WrappedIndex()  # an index op given a negative index (a label of -1)
        self.signed = SignedTotals(self._learned)  # a division by a signed total of 0
        self.quadratic = QuadraticForms()  # sqrt(x^T M x) of an indefinite buffer M
        self.fold = FoldCoverage()  # a division by nn.Fold's overlap count at uncovered pixels
        # the outputs of _TRANSFORMS, with the op's name and whether it took a learned value
        self._made: dict[int, tuple[weakref.ref, str, bool]] = {}
        self.compared: set[str] = set()  # the _TRANSFORMS whose two such outputs one op took
        # values whose rows along the samples' dimension are no samples' (a sort over the
        # batch: ``x_sorted[0]`` is each feature's minimum, not sample 0's record)
        self.mixed = TensorSet()

    # -- seeds

    def seed_samples(self, args: Sequence[Any], kwargs: dict[str, Any] | None = None,
                     skip: Iterable[torch.Tensor] = (), batched: bool = False) -> None:
        """Each tensor inside element ``i`` of a list or tuple as long as the batch (a
        ``collate_fn``'s targets, one dict per image) among a call's arguments belongs to
        sample ``i``; the argument list itself is none (an EGNN layer's ``(h, x, row, col)``
        in a batch of 4); ``skip``: the model outputs (a list of feature levels as long as the
        batch is not per sample). ``batched``: a tensor with the batch's samples (a loss's
        targets; not the model's inputs, which the model's own code transforms) holds every
        sample's record too."""
        self.wrapped.seed(tensor_leaves((args, kwargs or {})))  # (a label given: WrappedIndex)
        n, skipped = self.where.size, {id(t) for t in skip}
        if n < 2:
            return

        def walk(o: Any) -> None:
            if isinstance(o, dict):
                for v in o.values():
                    walk(v)
            elif isinstance(o, (list, tuple)):
                if len(o) == n and not all(self._batched(e) for e in o):
                    for i, e in enumerate(o):
                        for t in tensor_leaves(e):
                            if id(t) not in skipped:
                                self._put(t, frozenset((i,)))
                else:
                    for e in o:
                        walk(e)
            elif batched and isinstance(o, torch.Tensor) and id(o) not in skipped \
                    and self.where.dim(o) is not None:
                # a batched target (follow-up times, event flags): each row a sample's record
                self._put(o, frozenset(range(n)))

        for a in (*args, *(kwargs or {}).values()):
            walk(a)

    def _batched(self, e: Any) -> bool:
        """``e`` holds nothing per sample: only 0-d tensors or tensors with the batch's
        samples (one feature level of several as many as the batch)."""
        return all(t.dim() == 0 or self.where.dim(t) is not None for t in tensor_leaves(e))

    def seed_learned(self, tensors: Iterable[torch.Tensor]) -> None:
        for t in tensors:
            self.learned.add(t)

    # -- propagation (every op the finder sees, before anything else)

    def track(self, name: str, args: Sequence[Any], leaves: list, out: Any) -> None:
        if self.raw is not None:
            self.raw.track(name, args, out)
        self.log_sum_exp.track(name, args, out)
        self.counts.track(name, args, out)
        self.positives.track(name, args, out)
        self.product.track(name, args, out)
        self.power.track(name, args, out)
        self.crossed.track(name, args, out)
        self.signed.track(name, args, out)
        self.quadratic.track(name, args, out)
        self.fold.track(name, args, out)
        ins = [t for t in leaves if isinstance(t, torch.Tensor)]
        outs = [t for t in tensor_leaves(out)] if not isinstance(out, torch.Tensor) else [out]
        self.wrapped.track(name, args, ins, outs)
        if not ins or not outs:
            return
        learned = any(self._learned(t) for t in ins)
        if learned:
            for t in outs:
                self.learned.add(t)
        self._compare(name.rstrip("_"), ins, outs, learned)
        self._mix(name, args, ins, outs)
        picked = self._picked(name, args, outs)
        if picked is not None:
            for t, s in zip(outs, picked):
                self._put(t, s)
            return
        of = frozenset().union(*(self.of(t) for t in ins))
        if of and name in _JOINS and not all(self.of(t) for t in ins):
            # rows of values from no sample's record (an image without boxes, its targets
            # new_zeros) beside others: which rows came from where is not followed
            of = frozenset(range(self.where.size))
        if of:
            for t in outs:
                self._put(t, of | self.of(t))  # (an in-place op's output is its input)

    def compare(self, name: str, leaves: list, out: Any) -> None:
        """Only the comparison of :meth:`track` (after a NaN origin: ``compared_after``)."""
        ins = [t for t in leaves if isinstance(t, torch.Tensor)]
        outs = [out] if isinstance(out, torch.Tensor) else list(tensor_leaves(out))
        if ins and outs:
            learned = any(self._learned(t) for t in ins)
            for t in outs if learned else ():
                self.learned.add(t)
            self._compare(name.rstrip("_"), ins, outs, learned)

    def _compare(self, name: str, ins: list[torch.Tensor], outs: list[torch.Tensor],
                 learned: bool) -> None:
        if name in _TRANSFORMS:
            for t in outs:
                self._made[id(t)] = (weakref.ref(t), name, learned)
            return
        made = [m for t in ins if (m := self._made.get(id(t))) and m[0]() is t]
        if len(ins) == 1 and made:  # scaled or reshaped on its own: dB's 10 * log10(power)
            for t in outs:
                if t.numel() == ins[0].numel():
                    self._made[id(t)] = (weakref.ref(t), made[0][1], made[0][2])
            return
        for op in {m[1] for m in made}:
            sides = {(m[2], tuple(m[0]().shape)) for m in made if m[1] == op}
            if any((not w, shape) in sides for w, shape in sides):  # learned beside data
                self.compared.add(op)

    def _mix(self, name: str, args: Sequence[Any], ins: list[torch.Tensor],
             outs: list[torch.Tensor]) -> None:
        """Mark the outputs of an op over the samples' dimension that moves values across
        rows (``_REORDERS``), and those a mixed value's rows go on into (its views, slices)."""
        if name in _REORDERS and ins:
            i = _REORDERS[name]
            dim = args[i] if len(args) > i and isinstance(args[i], int) else -1
            d = self.where.dim(ins[0])
            mixed = d is not None and dim % max(ins[0].dim(), 1) == d
        else:
            mixed = any(t in self.mixed for t in ins)
        for t in outs if mixed else ():
            if self.where.dim(t) is not None:
                self.mixed.add(t)

    def _picked(self, name: str, args: Sequence[Any], outs: list[torch.Tensor]):
        """One sample per output of ``x[i]`` (select) or ``x.unbind()`` along the samples
        (not of a value whose rows are no samples')."""
        if name not in ("select", "unbind") or not args or not isinstance(args[0], torch.Tensor) \
                or args[0] in self.mixed:
            return None
        x, dim = args[0], (args[1] if len(args) > 1 else 0)
        d = self.where.dim(x)
        if d is None or not isinstance(dim, int) or dim % max(x.dim(), 1) != d:
            return None
        if name == "unbind":
            return [frozenset((i,)) for i in range(len(outs))]
        i = args[2] if len(args) > 2 else None
        return [frozenset((i % x.shape[d],))] if isinstance(i, int) else None

    # -- questions

    def of(self, t: torch.Tensor) -> frozenset[int]:
        hit = self._of.get(id(t))
        return hit[1] if hit is not None and hit[0]() is t else frozenset()

    def rows(self, t: torch.Tensor, shaped: list[int] | None) -> list[int] | None:
        """The samples ``t`` was made from, when they are some of the batch and its rows
        (``shaped``: what its shape says) do not name them more narrowly; else ``shaped``."""
        of = self.of(t)
        if not of or len(of) >= self.where.size or (shaped and set(shaped) <= of):
            return shaped
        return sorted(of)

    def of_data(self, ins: list[torch.Tensor]) -> bool:
        """No floating input of the op is learned, and one came from a sample's record: it
        computed on the data alone (not on a model input a model's own code mishandles)."""
        return bool(ins) and not any(self._learned(t) for t in ins) \
            and any(self.of(t) for t in ins)

    def _learned(self, t: torch.Tensor) -> bool:
        # (a forward under autograd: the weights and what they made require grad)
        return t.requires_grad or t in self.learned

    def _put(self, t: torch.Tensor, of: frozenset[int]) -> None:
        self._of[id(t)] = (weakref.ref(t), of)
