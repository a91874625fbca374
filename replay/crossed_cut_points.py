"""A difference of one increasing function at two points, negative: cut-points that crossed.

A cumulative-link (proportional-odds) model's class probability is ``sigmoid(t_k - f) -
sigmoid(t_{k-1} - f)`` (``Phi`` for ordered probit): positive only while the thresholds stay
ordered. Left unconstrained, two of them cross in training (the thresholds of a class the
batches rarely hold are pulled together and pass each other), the difference goes below 0
for that class's records, and the log under it makes NaN. The generic advice, a clamp at the
log, trains on a wrong probability; the fix is thresholds ordered by construction.
:class:`CrossedCutPoints` watches the ops (fed by :class:`~replay.lineage.Lineage`) for the
first ``F(a) - F(b)`` of one increasing ``F`` that is negative and reaches a pole op;
:func:`with_crossed` says so.
"""

from __future__ import annotations

import torch

from .memo import TensorMarks
from .source import user_source

# increasing functions whose differences are a distribution's interval probabilities
_INCREASING = {"sigmoid", "special_expit", "erf", "special_ndtr", "exp", "softplus"}
_POLES = {"log", "log2", "log10", "sqrt", "rsqrt", "pow"}  # (the input a negative breaks)
# ops that carry such a difference on to the pole op, its sign unchanged (p + eps, p[mask])
_CARRY = {"add", "view", "reshape", "_unsafe_view", "squeeze", "unsqueeze", "clone", "index",
          "select", "slice", "gather", "expand", "_to_copy", "to"}


class CrossedCutPoints:
    """The first ``F(a) - F(b)`` found negative that a pole op then took (``found``: ``F``,
    the difference's line, the positions along dim 0 where it is negative)."""

    def __init__(self):
        self._made = TensorMarks()  # the increasing function's name, per value it made
        # a negative difference and the values it went on into -> (F, its line, the rows)
        self._negative = TensorMarks()
        self.found: tuple[str, str | None, list[int]] | None = None

    def track(self, name: str, args, out) -> None:
        if self.found is not None or not isinstance(out, torch.Tensor) \
                or not out.is_floating_point():
            return
        given = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if name in _INCREASING:
            self._made.put(out, name)
        elif given is not None and (neg := self._negative.get(given)) is not None:
            if name in _POLES:  # (pow: a fractional one, sqrt's pole too)
                self.found = neg
            elif name in _CARRY:
                self._negative.put(out, neg)
        elif name == "sub" and len(args) >= 2 and out.dim() >= 1 \
                and all(isinstance(a, torch.Tensor) for a in args[:2]) \
                and (f := self._made.get(args[0])) is not None \
                and self._made.get(args[1]) == f and bool((out < 0).any()):
            rows = (out < 0).reshape(len(out), -1).any(1)
            self._negative.put(out, (f, user_source(), torch.nonzero(rows).flatten().tolist()))


def with_crossed(hint: str | None, cause: str | None, hit,
                 watch: CrossedCutPoints | None) -> str | None:
    """``hint``, for a pole op's NaN whose rows hold a negative ``F(a) - F(b)``, with why."""
    if hint is None or watch is None or watch.found is None or cause != "invalid" \
            or hit is None or hit.op.removeprefix("aten.") not in _POLES:
        return hint
    f, source, rows = watch.found
    if hit.rows and not set(hit.rows) & set(rows):
        return hint
    at = f" at {source}" if source else ""
    return (f"{hint}; but here that input is a difference {f}(a) - {f}(b) of an increasing "
            f"function{at}, below 0 in row(s) {rows[:8]} because a < b there: the cut-points "
            "of an interval probability are out of order (a cumulative-link model's "
            "thresholds t_k that crossed in training, unconstrained; a class the batches "
            "rarely hold pulls its two thresholds together). Keep them ordered by construction "
            "(t = t_0 + cumsum(softplus(deltas)), or sort them) rather than clamp the op's "
            "input, which trains on a wrong probability")
