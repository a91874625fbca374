"""A distance of exactly 0 to a parameter row that is a float32 copy of an activation.

Cluster centres set by k-means on the embeddings (DEC/IDEC's ``cluster_layer``, DeepCluster's
prototypes) or a codebook initialised from the batch's encoder outputs: a cluster of one point
has that point's embedding as its centre, bit for bit, and ``sqrt(((z - mu) ** 2).sum(-1))``
is ``sqrt(0)`` there, whose derivative is infinite. Exact arithmetic puts it there too; the
float64 re-run does not, as it widens the stored float32 copy but recomputes the embedding in
float64, and the two then differ by the embedding's rounding. Read as rounding (``precision``),
the hint sent users to a wider type. :func:`copied_row` finds the case on the autograd graph
(the sum of squares' saved difference has a whole row of exact zeros, against a parameter)
and :func:`recause` names it ``invalid``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cause_result import Cause
from .cause_text import DO
from .compat import saved_value
from .positive import node_op

# nodes between a root and its sum of squares that keep the values (a view, a reduction)
_THROUGH = {"Sum", "Mean", "View", "UnsafeView", "ReshapeAlias", "Squeeze", "Unsqueeze",
            "Clone", "Expand"}
_ROOTS = {"Sqrt", "Pow"}  # sqrt(x), x ** 0.5


@dataclass
class CopiedRow:
    param: torch.Tensor  # the parameter one of whose rows the activation equals
    row: int  # its index in the parameter's first dimension


def copied_row(node, depth: int = 6) -> CopiedRow | None:
    """For a root's backward ``node`` at its pole: the parameter row an activation equals
    exactly, where the root's input is the sum of the squares of their difference."""
    if node_op(node) not in _ROOTS:
        return None
    try:
        fn = node.next_functions[0][0]
        for _ in range(depth):
            if fn is None:
                return None
            op = node_op(fn)
            if op in ("Pow", "Mul"):
                return _from_square(fn)
            if op not in _THROUGH:
                return None
            fn = fn.next_functions[0][0]
    except Exception:  # (a freed node, one that cannot say)
        return None
    return None


def _from_square(square) -> CopiedRow | None:
    """``square`` (``d ** 2`` or ``d * d``) of ``d = a - b`` with ``b`` a parameter: the row
    of ``b`` whose difference to ``a`` is 0 in every element of the last dimension."""
    d = saved_value(square, "self")
    if not isinstance(d, torch.Tensor) or d.dim() < 2 or d.shape[-1] < 2:
        return None  # (one component: a 0 that rounding alone can make)
    sub = square.next_functions[0][0]
    if sub is None or node_op(sub) != "Sub":
        return None
    param = next((getattr(fn, "variable", None) for fn, _ in sub.next_functions
                  if fn is not None and fn.name().endswith("AccumulateGrad")), None)
    if param is None or param.dim() < 2:
        return None
    zero = (d == 0).all(dim=-1).nonzero()
    if not len(zero):
        return None
    return CopiedRow(param, int(zero[0, d.dim() - param.dim()]))


def recause(cause: Cause, node: str | None, found: CopiedRow | None, names: dict) -> Cause:
    """``cause`` for a backward origin at ``node``, ``invalid`` where ``found`` says the
    float64 re-run's finite gradient came only from widening a copied row."""
    if found is None or cause.name != "precision":
        return cause
    name = next((n for n, p in names.items() if p is found.param), "a parameter")
    return Cause("invalid", f"{node} made a non-finite gradient: it takes the sqrt of a "
                 f"squared distance that is exactly 0, as row {found.row} of {name} equals an "
                 "activation bit for bit (a centre set to the mean of a cluster of one point "
                 "by k-means on the embeddings, a codebook entry initialised from the batch's "
                 "outputs). The points coincide in exact arithmetic too, where the derivative "
                 "of sqrt is infinite (the float64 re-run, which recomputes the activation "
                 "but widens the stored copy, is off the pole only by rounding)"
                 + DO["sqrt_pole"] + "; a Student-t or Gaussian kernel takes the squared "
                 "distance, which needs no sqrt")
