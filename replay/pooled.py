"""Tensors that pool the batch: made by a reduction over the samples' dimension, or from such
tensors alone. Their rows are not samples, whatever their size.

A batch-wise Dice loss (MONAI's ``batch=True``, nnU-Net's ``batch_dice``) sums the one-hot
labels of a ``(B, C, D, H, W)`` batch over ``(0, 2, 3, 4)``: one volume per class, shape
``(C,)``. With as many classes as samples (a binary segmentation, two classes, in batches of
two) that shape reads as the batch's, and a class absent from the whole batch, whose weight
``1 / volume²`` is +inf, was named as the sample of the class's index. The op finder follows
the pooling instead: :meth:`Pooled.track` marks the outputs of such reductions, and of ops
whose floating inputs are all pooled (``1 / v ** 2``, ``w * inter``), and their rows name no
sample. A reduction over dim 0 of a square ``(B, B)`` matrix (a similarity of every pair of
samples) still leaves the other sample of each pair in its rows: it pools nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from recorder.samples import Samples

from .compat import saved_value
from .memo import TensorSet
from .positive import node_op

# reductions and the position of their ``dim`` argument (absent, None or []: every dim)
_DIM_AT = {"sum": 1, "mean": 1, "nansum": 1, "nanmean": 1, "amax": 1, "amin": 1,
           "prod": 1, "var": 1, "std": 1, "var_mean": 1, "std_mean": 1, "logsumexp": 1,
           "max": 1, "min": 1, "aminmax": None, "linalg_vector_norm": 2, "norm": 2}


class Pooled:
    """The tensors an op finder saw made from the whole batch pooled (see the module)."""

    def __init__(self, samples: Samples | None,
                 order: Callable[[torch.Tensor], torch.Tensor | None] = lambda t: None):
        self.samples = samples
        self.order = order  # the sample of each row, for rows not the batch's own
        self._made = TensorSet()

    def __contains__(self, t: torch.Tensor) -> bool:
        return t in self._made

    def track(self, name: str, args: tuple, kwargs: dict, ins: list[torch.Tensor],
              outs: list[torch.Tensor], held: Callable[[torch.Tensor], bool]) -> None:
        """Mark ``outs`` when op ``name`` pooled the samples of its first input, or took only
        pooled tensors and ``held`` ones (the weights, and values made from them alone)."""
        s = self.samples
        # (``ins`` leaves empty tensors out: a mean over no token pools no sample's either)
        if not (s and s.size) or not ins and not (args and isinstance(args[0], torch.Tensor)):
            return
        try:  # (a named dimension, "N", or a tensor without a shape: no pooling said)
            dims = _dims(name, args, kwargs) if name in _DIM_AT else False
        except (TypeError, ValueError):
            return
        if dims is not False and args and isinstance(args[0], torch.Tensor):
            pooled = self._pools(args[0], dims)
        else:  # (scalars alone: a stack of per-expert means)
            tensors = [t for t in ins if t.dim()] or ins
            pooled = any(t in self._made for t in tensors) \
                and all(t in self._made or held(t) for t in tensors)
        if pooled:
            for t in outs:
                self._made.add(t)

    def _pools(self, x: torch.Tensor, dims: list[int] | None) -> bool:
        d = self.samples.dim(x)
        if d is None and x.dim() and (order := self.order(x)) is not None:
            # (tokens or picks of several samples, or of none: a sum over no record)
            return (dims is None or 0 in [k % x.dim() for k in dims]) \
                and len(set(order.flatten().tolist())) != 1
        if d is None or x.dim() == 2 and x.shape[0] == x.shape[1]:
            return False
        return dims is None or d in [k % x.dim() for k in dims]


def _dims(name: str, args: tuple, kwargs: dict) -> list[int] | None | bool:
    """The dims op ``name`` reduces, None for all of them, False when this overload reduces
    nothing (``max(a, b)``, elementwise)."""
    at = _DIM_AT[name]
    dim = kwargs.get("dim", args[at] if at is not None and len(args) > at else None)
    if isinstance(dim, torch.Tensor):
        return False
    if dim is None or isinstance(dim, bool) or isinstance(dim, (list, tuple)) and not dim:
        return None  # (a bool: var(x, unbiased), over every dim)
    return [dim] if isinstance(dim, int) else [int(k) for k in dim]


# the same rule on the autograd graph, for a gradient's rows (the backward origin's): the
# reductions' nodes, whose saved ``dim`` (absent: every dim) and input sizes say what they pooled
_REDUCTION_NODES = {"Sum", "Mean", "Nansum", "Amax", "Amin", "Prod", "Var", "Std", "VarMean",
                    "StdMean", "Logsumexp", "LinalgVectorNorm", "Norm"}


def pooled_size(fn, where: Samples, limit: int = 20000) -> int | None:
    """The size (element count) of the largest value that pools the batch that autograd node
    ``fn``'s output was made of alone, None when that output is not such a value: a
    reduction over the samples made it, or ops of such values and of tensors that need no
    gradient (a no-grad class weight). A larger gradient for it broadcast the pooled values
    over something else. Walks at most ``limit`` nodes; past that, not pooled."""
    try:
        return _walk(fn, where, limit)
    except Exception:  # a node that cannot say (a custom Function's): not pooled
        return None


def _walk(fn, where: Samples, limit: int) -> int | None:
    memo: dict = {}
    stack = [fn]
    while stack:
        n = stack[-1]
        if n in memo:
            stack.pop()
            continue
        if (size := _reduced(n, where)) is not None:
            memo[n] = size
            stack.pop()
            continue
        kids = [f for f, _ in n.next_functions
                if f is not None and type(f).__name__ != "AccumulateGrad"]
        todo = [k for k in kids if k not in memo]
        if todo and len(memo) < limit:
            stack.extend(todo)
            continue
        sizes = [memo.get(k) for k in kids]
        memo[n] = max(sizes) if sizes and None not in sizes else None
        stack.pop()
    return memo.get(fn)


def _reduced(node, where: Samples) -> int | None:
    """The output size of reduction node ``node`` when it pooled the samples, else None."""
    if node_op(node) not in _REDUCTION_NODES:
        return None
    sizes = saved_value(node, "self_sym_sizes")
    if sizes is None and isinstance(t := saved_value(node, "self"), torch.Tensor):
        sizes = t.shape
    if sizes is None or not where.size:
        return None
    sizes = [int(s) for s in sizes]
    dims = saved_value(node, "dim")
    if not dims:  # (None or (): every dim)
        return 1
    # (autograd saves a negative dim as an unsigned 64-bit number: -1 reads 2**64 - 1)
    dims = {(k - 2 ** 64 if k >= 2 ** 63 else k) % len(sizes)
            for k in ([dims] if isinstance(dims, int) else dims)}
    d = where.dim(torch.empty(sizes, device="meta"))
    if d is None or d not in dims or len(sizes) == 2 and sizes[0] == sizes[1]:
        return None
    return math.prod(s for k, s in enumerate(sizes) if k not in dims)
