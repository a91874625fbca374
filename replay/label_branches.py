"""A loss's 0/1 factor that picks one of two branches per entry: a label, not a mask.

A log-loss written out, ``y * log(1 + exp(-z)) + (1 - y) * log(1 + exp(z))`` (or
``y * log(p) + (1 - y) * log(1 - p)``), computes both branches at every entry and multiplies
the one the label leaves out by 0. When that branch overflowed (a hand-written softplus of a
rare code's very negative logit, under float16) or hit its pole (``log(1 - p)`` of a
saturated sigmoid), ``inf * 0`` is NaN; the entry is not left out of the loss (the other
branch covers it) and no padding is involved, so ``replay.masked_overflow``'s padding advice
is wrong there. The sign: the loss also takes the complement of the same 0/1 factor
(``1 - y``), which a padding mask's left-out entries never get.
"""

from __future__ import annotations

import torch

# the hint that replaces the padding advice when the 0/1 factor is a label
BRANCH = (
    ". But every non-finite value it led to was then multiplied by 0 in {op}{at}, by a 0/1 "
    "factor the loss also takes as its complement (1 - y): a label that picks one branch of "
    "the loss per entry, both branches computed everywhere, and inf * 0 is NaN. No entry is "
    "left out and no padding is involved: write each branch in a form finite for every input "
    "(F.softplus(z), F.logsigmoid(z), or the whole loss as "
    "F.binary_cross_entropy_with_logits(z, y)); torch.where(y == 1, a, b) picks a branch "
    "without multiplying the other one's infinity, though its gradient still goes through it")


def complement_of(name: str, args) -> torch.Tensor | None:
    """The tensor aten op ``name`` (on ``args``) takes the complement of: ``1 - y`` (``rsub``
    by 1, or ``ones - y``); None for any other op (a bool mask's ``~mask`` is a mask's: a
    padding mask's left-out entries filled, not a branch)."""
    if name == "rsub" and len(args) >= 2 and isinstance(args[0], torch.Tensor) \
            and not isinstance(args[1], torch.Tensor) and args[1] == 1:
        return args[0]
    if name == "sub" and len(args) >= 2 and all(isinstance(a, torch.Tensor) for a in args[:2]) \
            and args[0].is_floating_point() and args[0].numel() and bool((args[0] == 1).all()):
        return args[1]
    return None


def picks_branch(factors, complemented) -> bool:
    """Whether a 0/1 operand of the masking product (``factors``) is a tensor whose complement
    the loss took (``complemented``): the same memory and shape."""
    return any(_same(f, c) for f in factors for c in complemented
               if isinstance(f, torch.Tensor))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (a.device == b.device and a.data_ptr() == b.data_ptr()
                      and a.shape == b.shape)
