"""A quotient whose divisor is a learned value times a factor of the data alone that is 0 in
some samples' rows.

A neural SDE fitted to irregular series normalises each increment by its Euler-Maruyama
scale, ``(dx - f dt) / (g * dt.sqrt())``: a record with a duplicated timestamp has ``dt = 0``
there, and the quotient is ``x / 0``. The divisor is learned (``g``), so :mod:`replay.
data_divisor` says nothing and the hint said to add an eps to the denominator, which would
weight that transition by ``1 / eps``; but its 0 is the data factor's, a degenerate record.
:func:`marked` reads that factor off the divisor's product node (the one of its operands no
gradient reaches, as the node saved it) and :data:`ADVICE` is what the hint adds.
"""

from __future__ import annotations

import torch

from .compat import saved_value
from .positive import node_op

_DIVIDES = {"div", "true_divide", "divide"}

ADVICE = (
    "; but its divisor there is a learned value times a factor no gradient reaches (computed "
    "from the data: a time step, a length, a count), and that factor is exactly 0 at the "
    "samples named: their records are degenerate there (a duplicated "
    "timestamp's dt = 0, an interval or box of zero width), and an eps would weight them by "
    "1/eps: repair such records where the data is made (drop or merge duplicated times) or "
    "leave those entries out (a mask of factor > 0)")


def marked(op: str, ins: list[torch.Tensor], rows: list[int] | None, size: int) -> bool:
    """``op`` divided by a product of a learned value and a factor no gradient reaches
    holding an exact 0, in some of the batch's ``size`` samples (``rows``) only (so not a
    constant or a hyperparameter, which would be 0 in every sample)."""
    if not rows or len(rows) >= size or len(ins) != 2 \
            or op.removeprefix("aten.").split(".")[0].rstrip("_") not in _DIVIDES:
        return False
    try:
        node = ins[1].grad_fn
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
