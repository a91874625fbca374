"""An index op given a negative index, which Python's rule counted from the end.

A label off by one (a 1..K rating scale shifted twice, -1 stored for a missing grade) picks
``t[y]`` of a cumulative-link loss's padded thresholds ``cat([-inf, t, inf])``: ``t[-1]`` is
the last entry, ``+inf``, and ``sigmoid(t[y + 1] - f) - sigmoid(t[y] - f)`` is ``0 - 1``
under the log. No op fails: the NaN is the log's, whose generic advice (clamp its input)
would hide the bad label. :class:`WrappedIndex` watches the ops (fed by
:class:`~replay.lineage.Lineage`) for the first integer index made of what the watched call
was given (a label, not the code's own ``arange(n) - 1``) holding a negative entry;
:func:`with_wrapped_index` names it, its rows and line, where the origin's rows are among them.
"""

from __future__ import annotations

import torch

from .memo import TensorSet
from .source import user_source

# index ops and which of their arguments holds the index (aten.index: a list of them)
_INDEXED = {"index": 1, "index_select": 2, "gather": 2, "take": 1, "take_along_dim": 1,
            "embedding": 1}
_CAUSES = ("invalid", "overflow", "underflow")


class WrappedIndex:
    """The first index op that took a negative index (``found``: the op, its line, the
    lowest index, and the positions along the index's dim 0 that hold a negative one)."""

    def __init__(self):
        self.found: tuple[str, str | None, int, list[int]] | None = None
        # the tensors the watched call was given (a label) and those ops made of them, not
        # an index the code made of nothing given: ``arange(n) - 1`` wraps on purpose
        self._given = TensorSet()

    def seed(self, tensors) -> None:
        for t in tensors:
            self._given.add(t)

    def track(self, name: str, args, leaves: list, outs: list) -> None:
        if self.found is not None:
            return
        if any(isinstance(t, torch.Tensor) and t in self._given for t in leaves):
            for t in outs:
                self._given.add(t)
        if name not in _INDEXED or len(args) <= _INDEXED[name]:
            return
        given = args[_INDEXED[name]]
        for i in given if isinstance(given, (list, tuple)) else (given,):
            if isinstance(i, torch.Tensor) and i.numel() and not i.is_floating_point() \
                    and i.dtype != torch.bool and i in self._given and bool((i < 0).any()):
                rows = (i < 0).reshape(len(i), -1).any(1) if i.dim() else i.reshape(1) < 0
                self.found = (f"aten.{name}", user_source(), int(i.min()),
                              torch.nonzero(rows).flatten().tolist())
                return


def with_wrapped_index(hint: str | None, cause: str | None, hit,
                       watch: WrappedIndex | None) -> str | None:
    """``hint`` led by the negative index an index op took before the blamed op, when the
    blamed op's rows (if it names any) are among that index's negative ones."""
    if hint is None or watch is None or watch.found is None or cause not in _CAUSES \
            or hit is None:
        return hint
    op, source, low, rows = watch.found
    if hit.rows and not set(hit.rows) & set(rows):
        return hint
    at = f" at {source}" if source else ""
    return (f"{op}{at} was given a negative index ({low}) in row(s) {rows[:8]}: Python's "
            "rule counts it from the end (t[-1] is the last entry: a threshold past the last "
            "class, a padding's inf), so those rows picked the wrong entries before "
            f"{hit.op} made {hit.made}. A label or id off by one (a 1..K scale shifted twice, "
            "-1 stored for a missing label) is the usual source: map the labels to 0..K-1 "
            "and drop or mask the missing ones (assert y.min() >= 0) rather than clamp the "
            f"op's input. The op's own reading: {hint}")
