"""A division by a per-group count or total the code accumulated, 0 for a group with no member.

A mean per group written by hand: ``total = zeros(G).index_add(0, group, x)``, ``count =
zeros(G).index_add(0, group, ones)`` (or ``scatter_add``, ``bincount``), then ``total / count``.
A group the batch holds no element of (a region whose background points a mask clipped away,
a class absent from the batch) has a count of 0 and a mean of 0/0. No sample is to blame and
an eps silently makes that group's term 0 (a region's integral of 0 lets its intensity grow
without bound); the fix is to leave empty groups out or to give every group members. The
same for the row sums of a 0/1 matrix (an adjacency's degrees, an island cell's 0).
:class:`EmptyGroups` watches the ops (fed by :class:`~replay.lineage.Lineage`) for a division
by such an accumulated value at an entry it holds 0; :func:`with_empty_groups` then says so.
"""

from __future__ import annotations

import torch

from .memo import TensorMarks

_ACCUMULATE = {"index_add", "index_add_", "scatter_add", "scatter_add_", "scatter_reduce",
               "scatter_reduce_", "bincount", "index_put", "index_put_"}
_CARRY = {"view", "reshape", "_unsafe_view", "squeeze", "unsqueeze", "clone", "expand",
          "_to_copy", "to", "float", "unsqueeze_"}
_DIVISIONS = {"div", "div_", "reciprocal", "reciprocal_"}


class EmptyGroups:
    """Whether a division's divisor was accumulated per group (``found``: the accumulating
    op and the groups it left at 0)."""

    def __init__(self):
        self._made = TensorMarks()  # the accumulating op's name, per value it made
        self.found: tuple[str, list[int]] | None = None

    def _op(self, t) -> str | None:
        return self._made.get(t) if isinstance(t, torch.Tensor) else None

    def track(self, name: str, args, out) -> None:
        if self.found is not None or not args or not isinstance(out, torch.Tensor):
            return
        if name == "sum" and len(args) > 1 and _zero_one(args[0]):
            self._made.put(out, "sum")  # (the row counts of a 0/1 matrix: a node's degree)
        elif name in _ACCUMULATE and (not name.startswith("index_put")
                                    or len(args) > 3 and args[3] is True):  # (accumulate=True)
            self._made.put(out, name.rstrip("_"))
        elif name in _CARRY and (op := self._op(args[0])) is not None:
            self._made.put(out, op)
        elif name in _DIVISIONS and out.is_floating_point() and not bool(out.isfinite().all()):
            d = args[0] if name.startswith("reciprocal") else args[1] if len(args) > 1 else None
            if (op := self._op(d)) is not None and d.dim() >= 1 and bool((d == 0).any()):
                # (the groups along the first dim: ``count[:, None]`` broadcast over features)
                empty = (d == 0).reshape(d.shape[0], -1).any(1)
                self.found = op, torch.nonzero(empty).flatten().tolist()


def _zero_one(x) -> bool:
    """``x`` is a 0/1 matrix (an adjacency, a membership or mask matrix): its row sums are
    counts."""
    return isinstance(x, torch.Tensor) and x.dim() == 2 and x.is_floating_point() \
        and x.shape[0] > 1 and bool(((x == 0) | (x == 1)).all())


def with_empty_groups(hint: str | None, cause: str | None, hit,
                      watch: EmptyGroups | None) -> str | None:
    """``hint``, for a division by a per-group accumulation that is 0 at some groups."""
    if hint is None or watch is None or watch.found is None or cause != "invalid" \
            or hit is None or hit.op.removeprefix("aten.") not in _DIVISIONS:
        return hint
    op, groups = watch.found
    if op == "sum":
        return (f"{hint}; but here the divisor is the row sums of a 0/1 matrix (an adjacency's "
                f"degrees, a membership count), 0 at row(s) {groups[:8]}: those rows have no "
                "entry (an isolated node, a grid cell whose neighbours are all masked out: an "
                "island). No record is to blame, and an eps would drop those rows' terms in "
                "silence: give them a neighbour or leave them out (deg > 0), or divide by "
                "deg.clamp(min=1) where 0 is the right mean of no neighbours")
    return (f"{hint}; but here the divisor was accumulated per group by {op} (a count or total "
            f"per group, a mean written by hand), and it is 0 at group(s) {groups[:8]}: no "
            "element of the batch fell in them (a region with no background point, a class "
            "absent from the batch). No record is to blame, and an eps would make those "
            "groups' terms 0 in silence: leave the empty groups out (count > 0), or make "
            "the sampler put members of every group in each batch")
