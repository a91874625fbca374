"""Sign verdicts on autograd nodes taken while their saved values still exist.

A run's backward frees the values its nodes saved (a constant factor's: ``exp(s) * polarity``
saves ``polarity`` for ``s``'s gradient), and reading one after raises, so a graph rule asked
after the backward (of a model output the loss re-run takes) cannot tell that factor's sign.
The run takes the verdicts on its outputs' nodes right after their forward; each holds its
node, so the node's id names no other while the verdict lives, and the run holds the
verdicts: they go with it.
"""

from __future__ import annotations

import weakref


class Verdict:
    """One node's sign verdict, kept by the run that made the node."""

    __slots__ = ("node", "sign", "__weakref__")

    def __init__(self, node, sign: int):
        self.node, self.sign = node, sign


# node id -> the verdict a live run keeps for it (gone with the run)
_KEPT: weakref.WeakValueDictionary[int, Verdict] = weakref.WeakValueDictionary()


def remember(node, sign: int) -> Verdict:
    """Keep ``sign`` for ``node`` for as long as the returned verdict lives."""
    verdict = _KEPT[id(node)] = Verdict(node, sign)
    return verdict


def recall(node) -> int | None:
    """The sign kept for ``node``, or None when none is."""
    hit = _KEPT.get(id(node))
    return hit.sign if hit is not None and hit.node is node else None
