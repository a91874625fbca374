"""A log of a product over a dimension that underflowed: ``log(psi * p.prod(1) + ...)``.

An occupancy model's detection history ``prod_j p^y (1 - p)^(1 - y)`` over many visits, an
independent-Bernoulli likelihood, a naive-Bayes score: each factor is a fine probability but
their product over dozens of them falls below float32's smallest number and rounds to 0, and
the log then takes -inf. The general log-space list (log_softmax, logsumexp) does not say
where the 0 was made; the fix is to sum the factors' logs instead of taking the log of their
product. :class:`ProductUnderflow` watches the ops (fed by :class:`~replay.lineage.Lineage`)
for a ``prod`` whose 0 is made of nonzero factors, followed through elementwise arithmetic
and views to a log; :func:`with_product_underflow` then says so in the hint. A product kept
running in a loop (``p = p * term``: a Plackett-Luce ranking's softmax terms over a shrinking
candidate set, an HMM's unscaled forward pass) is no ``prod``: its ``mul`` ops are counted
as a chain of factors (a ``torch.ones`` start counts none), and a ``mul`` of at least three
factors whose 0 two nonzero operands made is the product's underflow. An HMM's or a CRF's
forward pass in probability space, ``alpha = (alpha @ A) * emit`` kept by
``torch.where(mask, alpha_new, alpha)`` over padding, chains its factors through the matrix
product and the ``where`` too: a ``matmul`` counts both operands' factors (its 0 of a nonzero
row and a nonzero matrix is the underflow), a ``where`` keeps the most of its two choices',
and a sum over the final alpha carries its 0 to the log.
"""

from __future__ import annotations

import torch

from .crossed_cut_points import with_crossed
from .fold_coverage import with_fold_coverage
from .group_counts import class_counts_hint, with_empty_groups
from .log_sum_exp import with_log_sum_exp
from .memo import TensorMemo, TensorSet
from .power_limit import with_power_limit
from .signed_total import with_signed_total
from .wrapped_index import with_wrapped_index

# ops a product's 0 passes through to the log unchanged in kind (a mixture's psi * hist + ...)
_CARRY = {"mul", "add", "sub", "rsub", "view", "reshape", "_unsafe_view", "squeeze",
          "unsqueeze", "clone", "index", "select", "slice", "expand", "t", "transpose", "where",
          "sum"}
_MATMULS = {"mm", "matmul", "bmm"}  # a running vector times one matrix factor per step
_LOGS = {"log", "log2", "log10"}
_ONES = {"ones", "ones_like"}  # the start of a running product, no factor of its own
_CHAIN = 3  # factors of a running product before its 0 reads as an underflow


class ProductUnderflow:
    """Whether a log took a value made of a ``prod`` that underflowed to 0 (``found``: how
    many factors that product had)."""

    def __init__(self):
        self._made = TensorSet()
        self._n = 0
        self._factors = TensorMemo()  # a running product's factors so far, per mul output
        self.found: int | None = None
        self.running = False  # (the product a loop kept, ``p = p * term``, not a ``prod``)

    def track(self, name: str, args, out) -> None:
        if name in _ONES and isinstance(out, torch.Tensor):
            self._factors.put(out, 0)
            return
        if self.found is not None or not args or not isinstance(x := args[0], torch.Tensor) \
                or not isinstance(out, torch.Tensor):
            return
        if name == "prod" and x.is_floating_point() and x.numel() > 1:
            dim = args[1] if len(args) > 1 and isinstance(args[1], int) else None
            nonzero = (x != 0).all() if dim is None else (x != 0).all(dim)
            if dim is not None and out.dim() != nonzero.dim():  # (keepdim=True)
                nonzero = nonzero.unsqueeze(dim)
            if bool(((out == 0) & nonzero).any()):  # (0 of nonzero factors: an underflow)
                self._made.add(out)
                self._n = x.numel() if dim is None else x.shape[dim]
        elif name in ("mul", *_MATMULS) and self._running(args, out, name != "mul"):
            return
        elif name == "where" and len(args) == 3:
            self._factors.put(out, max(self._factors.get(t) or 0 for t in args[1:]
                                       if isinstance(t, torch.Tensor)))
            if any(isinstance(t, torch.Tensor) and t in self._made for t in args[1:]):
                self._made.add(out)
        elif name in _CARRY and any(isinstance(a, torch.Tensor) and a in self._made
                                    for a in args):
            self._made.add(out)
        elif name in _LOGS and x in self._made:
            self.found = self._n

    def _running(self, args, out: torch.Tensor, matmul: bool = False) -> bool:
        """Count a ``mul`` (or a matrix product) of two floating tensors as a running
        product's next factor; True where it made a 0 of nonzero factors after at least
        ``_CHAIN`` of them."""
        a, b = args[0], args[1] if len(args) > 1 else None
        if not isinstance(b, torch.Tensor) or not a.is_floating_point() \
                or not b.is_floating_point() or torch.strided != a.layout or torch.strided != b.layout \
                or (a.dim() < 2 or b.dim() < 2 if matmul else out.shape not in (a.shape, b.shape)):
            return False
        n = sum(1 if (k := self._factors.get(t)) is None else k for t in (a, b))
        self._factors.put(out, n)
        made = (out == 0) & (a != 0).all(-1, keepdim=True) & bool((b != 0).all()) if matmul \
            else (out == 0) & (a != 0) & (b != 0)
        if n < _CHAIN or not bool(made.any()):
            return False
        self._made.add(out)
        self._n, self.running = n, True
        return True


def with_product_underflow(hint: str | None, cause: str | None, hit,
                           watch: ProductUnderflow | None) -> str | None:
    """``hint``, for a log's underflow whose 0 a product over a dimension made, with the fix."""
    if hint is None or watch is None or watch.found is None or cause != "underflow" \
            or hit is None or hit.op.removeprefix("aten.") not in _LOGS:
        return hint
    made = ("kept running in a loop (p = p * term: a Plackett-Luce ranking's softmax terms "
            "over a shrinking candidate set, an HMM's unscaled forward pass)" if watch.running
            else "(prod over a dimension: a detection history's p^y (1 - p)^(1 - y) over many "
            "visits, independent likelihoods)")
    return (f"{hint}; but here the 0 is a product of {watch.found} nonzero factors {made} "
            "that underflowed before the log: sum the factors' logs "
            "instead (log prod p = sum log p; logsigmoid(z) and logsigmoid(-z) for sigmoid "
            "probabilities) and join what the product was added to with torch.logaddexp or "
            "torch.logsumexp (log(a * prod p + b) = logaddexp(log a + sum log p, log b))")


def lineage_hints(hint: str | None, cause: str | None, hit, lineage) -> str | None:
    """``hint`` with what the op took, as the lineage of the ops saw it: a log-sum-exp written
    out, a product that underflowed, a power transform at its exponent's 0 (Box-Cox at
    lam = 0), a count per group with empty groups, a negative index, a difference of one
    increasing function that is negative (crossed thresholds)."""
    hint = with_log_sum_exp(hint, cause, hit, lineage.log_sum_exp)
    hint = with_empty_groups(hint, cause, hit, lineage.counts)
    hint = with_fold_coverage(hint, cause, hit, lineage.fold)
    hint = with_product_underflow(hint, cause, hit, lineage.product)
    hint = with_power_limit(hint, cause, hit, lineage.power)
    hint = with_signed_total(hint, cause, hit, lineage.signed)
    # (a label of -1 picks the pad past the last threshold: crossed cut-points too, but the
    # label is what to fix)
    wrapped = with_wrapped_index(hint, cause, hit, lineage.wrapped)
    return wrapped if wrapped is not hint else with_crossed(hint, cause, hit, lineage.crossed)


def loss_lineage_hint(lineage, cause, hit) -> str | None:
    """A loss origin's hint: a count per class's (:mod:`replay.group_counts`), else the
    cause's with what the lineage saw (see :func:`lineage_hints`)."""
    return class_counts_hint(lineage.counts, cause.name, hit) or lineage_hints(
        cause.hint, cause.name, hit, lineage)
