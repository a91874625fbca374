"""Values non-zero in exact arithmetic though of either sign, as the op finder sees ops run.

A signed amplitude (``exp(s) * polarity`` of a +-1 buffer, ``torch.sign(w) * softplus(v)``)
is never 0 in exact arithmetic, so a 0 it holds underflowed: a division by it or a log of its
square met no pole of the data's making. Ops that pass values on or pick entries of them keep
that, and so do products of such factors and integral powers (an even one is > 0: ``amp ** 2``);
sums do not (terms of either sign may cancel exactly).
"""

from __future__ import annotations

import torch

from .memo import TensorSet
from .positive import PASS_ON, SELECTS, made_nonzero

NONZERO_KEPT = PASS_ON | SELECTS | {"reciprocal"}  # (not neg: -d2 of a positive d2 stays
# what it was, a negative value the cause rules read as such)
# ops of a non-zero value that are > 0 wherever it is non-zero
MADE_POSITIVE = {"abs", "square"}
_FOLLOWED = NONZERO_KEPT | MADE_POSITIVE | {"mul", "pow"}


def nonzero_result(name: str, ins: list[torch.Tensor], leaves: list, nonzero) -> int:
    """1 when op ``name``, given finite inputs ``ins`` (``leaves``: all its arguments), made a
    value positive in exact arithmetic from one ``nonzero(t)`` says is non-zero, 2 when it
    made one non-zero of either sign, else 0."""
    if not ins or name not in _FOLLOWED or not nonzero(ins[0]):
        return 0
    if name in MADE_POSITIVE or (name == "mul" and len(leaves) == 2 and leaves[1] is ins[0]):
        return 1  # (x * x)
    if name == "pow":  # (a tensor exponent's values say nothing of the base's power)
        e = leaves[1] if len(leaves) == 2 else None
        if not isinstance(e, (int, float)) or isinstance(e, bool) or not float(e).is_integer():
            return 0
        return 1 if e % 2 == 0 else 2
    if name in SELECTS:
        return 2 if all(nonzero(t) for t in ins) else 0
    if name in NONZERO_KEPT:  # (div's divisor finite: a non-zero over it stays non-zero)
        return 2
    if name == "mul":  # (every factor non-zero: a tensor by its values, a number by itself)
        return 2 if _factors_nonzero(ins, leaves, nonzero) else 0
    return 0


def _factors_nonzero(ins: list[torch.Tensor], leaves: list, nonzero) -> bool:
    for v in leaves:  # (the floating tensors are ``ins``; a bool or integer mask is read here)
        if isinstance(v, torch.Tensor) and not v.is_floating_point():
            if not bool((v != 0).all()):
                return False
        elif isinstance(v, (int, float)) and v == 0:
            return False
    return all(nonzero(t) or bool((t != 0).all()) for t in ins)


class NonZero:
    """What the op finder ``finder`` holds non-zero of either sign: marked where the loss
    re-run takes a model output detached, followed as its ops run, or read on the graph."""

    def __init__(self, finder):
        self.finder = finder
        self._made = TensorSet()  # non-zero of either sign
        self._signed = TensorSet()  # and what ops made of those (amp ** 2: > 0)

    def __call__(self, t: torch.Tensor) -> bool:
        """``t`` is non-zero in exact arithmetic, of one sign or of either: its zeros
        underflowed, as those of a value the finder holds positive do."""
        f = self.finder  # (the graph walk first: it says positive too)
        return t in self._made or (f.partly.mask(t) is None and made_nonzero(t.grad_fn)) or (
            f.positive(t))

    def signed(self, t: torch.Tensor) -> bool:
        """``t`` is non-zero of either sign, or an op made it > 0 of one (``amp ** 2``)."""
        return t in self._signed or not self.finder.positive(t) and self(t)

    def mark(self, fn, t: torch.Tensor) -> None:
        """``t`` stands for the value autograd node ``fn`` made (a detached model output)."""
        if not self.finder.positive(t) and made_nonzero(fn):
            self._made.add(t)
            self._signed.add(t)

    def track(self, name: str, ins: list[torch.Tensor], leaves: list,
              outs: list[torch.Tensor]) -> int:
        """:func:`nonzero_result` of an op the finder saw run (no positive result), its
        outputs marked; 1 (> 0) is the finder's to keep as positive."""
        made = nonzero_result(name, ins, leaves, self)
        for t in outs if made else ():
            self._signed.add(t)
            if made == 2:
                self._made.add(t)
        return made
