"""A quotient of a learned value whose divisor, or a factor of it, is a value of the data
alone that is 0 in some samples' rows.

A neural SDE fitted to irregular series normalises each increment by its Euler-Maruyama
scale, ``(dx - f dt) / (g * dt.sqrt())``: a record with a duplicated timestamp has ``dt = 0``
there, and the quotient is ``x / 0``. The divisor is learned (``g``), so :mod:`replay.
data_divisor` says nothing and the hint said to add an eps to the denominator, which would
weight that transition by ``1 / eps``; but its 0 is the data factor's, a degenerate record.
So for a divisor no gradient reaches at all, in the forward (where :mod:`replay.lineage` does
not follow the model's inputs): a VP SDE's score ``net(x_t, t) / std(t)`` at a discrete time
``t = 0``, where the marginal std is 0.
:func:`marked` reads that factor off the divisor's product node (the one of its operands no
gradient reaches, as the node saved it) and :data:`ADVICE` is what the hint adds.
"""

from __future__ import annotations

import torch

from .compat import saved_value
from .positive import node_op

_DIVIDES = {"div", "true_divide", "divide"}

ADVICE = (
    "; but its divisor there, or a factor of it, is a value no gradient reaches (computed "
    "from the data: a time or time step, a length, a count) that is exactly 0 at the samples "
    "named: their records put it on the pole (a diffusion time t = 0 where the noise "
    "schedule's std vanishes, a duplicated timestamp's dt = 0, an interval of zero width), "
    "and an eps would weight them by 1/eps: keep such values out where the data is made "
    "(sample t from [eps, 1], drop or merge duplicated times) or leave those entries out "
    "(a mask of factor > 0)")


def marked(op: str, ins: list[torch.Tensor], rows: list[int] | None, size: int) -> bool:
    """``op`` divided a learned value by a value no gradient reaches, or by a product of a
    learned value and such a factor, holding an exact 0, in some of the batch's ``size``
    samples (``rows``) only (so not a constant or a hyperparameter, 0 in every sample), with
    a non-zero dividend there."""
    if not rows or len(rows) >= size or len(ins) != 2 \
            or op.removeprefix("aten.").split(".")[0].rstrip("_") not in _DIVIDES:
        return False
    try:
        num, den = ins
        # x / 0 of a non-zero x only: a 0/0 (a sum over an empty group by its count of 0) is
        # what an eps or a count floor turns into 0, the usual advice (as replay.data_divisor)
        if not bool(((den == 0) & (num != 0)).any()):
            return False
        node = den.grad_fn
        if node is None and not den.requires_grad:  # (the divisor as a whole: a VP SDE's std
            # of each record's time under a learned score)
            return (num.requires_grad or num.grad_fn is not None) and den.dim() > 0
        if node is None or node_op(node) != "Mul":
            return False
        learned = [f is not None for f, _ in node.next_functions]
        if learned == [True, False]:  # (self * data: the node saved the data as other)
            factor = saved_value(node, "other")
        elif learned == [False, True]:
            factor = saved_value(node, "self")
        else:
            return False
        return isinstance(factor, torch.Tensor) and factor.dim() > 0 \
            and bool((factor == 0).any())
    except Exception:  # (a freed node, a value that cannot be read here: say nothing)
        return False
