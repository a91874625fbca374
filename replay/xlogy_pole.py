"""A backward origin at ``xlogy(x, y)`` where x and y are both 0.

``torch.xlogy`` is the fix the replay gives for ``p * log(p)`` (0 log 0 is 0 by convention,
not NaN), and a KL / Poisson NMF loss ``xlogy(v, v) - xlogy(v, wh)`` takes counts of 0 with
it; but the gradient for ``y`` is ``x / y``, 0/0 where the model's ``y`` is exactly 0 too (a
rate or a factor row a projection ``clamp_(min=0)`` or a ReLU ended at 0). The forward is
finite, the backward NaN: the generic hint (a masked forward's other branch) does not say it.
Where y is 0 exactly where x is (y made from x: a Poisson deviance's ``xlogy(y, y / mu)``, a
KL's ``xlogy(p, p / q)``), every x of 0, the valid value the convention is for (a policy with
no claim), is at the pole, whatever the model makes: the log is split instead
(:data:`ZERO_OF_X`), and no record is to drop. Where y is x itself (an entropy's ``xlogy(p, p)``: a softmax's exact 0s
under a -inf mask) splitting cannot help: the log's argument is kept off 0 instead
(:data:`OF_ITSELF`).
"""

from __future__ import annotations

import torch

from .compat import saved_value
from .positive import node_op

ZERO_ZERO = (
    "{node} made a non-finite gradient from finite incoming gradients, in float64 too: "
    "xlogy(x, y) is 0 where x = 0 by convention (0 log 0 = 0) even at y = 0, but its gradient "
    "for y is x / y, 0/0 = NaN where y is exactly 0 as well; y is something the model makes (a "
    "rate or a probability; W @ H of a factor row that a projection clamp_(min=0), a ReLU or "
    "an underflow left all 0): keep it off 0 before the xlogy (project onto [eps, inf) with "
    "clamp_(min=eps), softplus(...) + eps, y + eps)")


# (said of x's zeros: valid values, no blank records: replay.zero_records)
VALID_ZEROS = "the valid value the convention is for"
ZERO_OF_X = (
    "{node} made a non-finite gradient from finite incoming gradients, in float64 too: "
    "xlogy(x, y) is 0 where x = 0 by convention (0 log 0 = 0) even at y = 0, but its gradient "
    "for y is x / y, 0/0 = NaN where y is exactly 0 as well; here y is 0 exactly where x is "
    "(y is made from x: a ratio x / m, as a Poisson deviance's xlogy(y, y / mu) or a KL's "
    f"xlogy(p, p / q)), so every x of 0, {VALID_ZEROS} (a count of none, a probability "
    "of 0), is on the pole, whatever the model makes: split the log so that y does not take "
    "x's zeros, xlogy(x, x) - x * log(m) (with the model's log output for log(m) where it has "
    "one), and keep those samples")


OF_ITSELF = (
    "{node} made a non-finite gradient from finite incoming gradients, in float64 too: "
    "xlogy(p, p) is an entropy's p log p, 0 at p = 0 by convention, but its derivative "
    "log p + 1 is -inf there (the gradient for the log's p is p / p, 0/0 = NaN): every "
    "probability of exactly 0 (a softmax over a -inf mask, an exp that underflowed) is on the "
    "pole, whatever the model makes, and splitting the log cannot move it; keep the log's "
    "argument off 0, xlogy(p, p.clamp_min(torch.finfo(p.dtype).tiny)) (still 0 at p = 0, "
    "with a finite gradient), or take the entropy of the scores, -(p * log_softmax(s)).sum(-1), "
    "with masked scores filled with torch.finfo(s.dtype).min rather than -inf")


def xlogy_of_itself(node) -> bool:
    """:func:`xlogy_at_zero` of ``xlogy(p, p)`` (an entropy): x and y are the same values."""
    if not xlogy_at_zero(node):
        return False
    x, y = saved_value(node, "self"), saved_value(node, "other")
    return x.shape == y.shape and bool(torch.equal(x, y))


def xlogy_of_x(node) -> bool:
    """:func:`xlogy_at_zero`, with y exactly 0 where x is and nowhere else (y made from x)."""
    if not xlogy_at_zero(node):
        return False
    x, y = saved_value(node, "self"), saved_value(node, "other")
    return bool(((x == 0) == (y == 0)).all())


def xlogy_at_zero(node) -> bool:
    """``node`` is xlogy's backward, its ``other`` needing a gradient, and it saved an entry
    with both arguments exactly 0 (the gradient x / y is 0/0 there)."""
    try:
        if node_op(node) != "Xlogy" or node.next_functions[1][0] is None:
            return False
        x, y = saved_value(node, "self"), saved_value(node, "other")
    except Exception:  # (a freed node, a scalar argument: unknown)
        return False
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        return False
    try:
        return bool(((x == 0) & (y == 0)).any())
    except RuntimeError:  # (shapes that do not broadcast: not this op's)
        return False
