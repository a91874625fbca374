"""A pole or domain edge reached by a difference of a cumulative sum's entries.

Segment sums taken with the cumsum trick (Lift-Splat-Shoot's ``QuickCumsum`` and BEVDet's
voxel pooling: sort by voxel rank, ``cumsum``, differences at the rank boundaries; a
summed-area table's box sums) are each the difference of two entries of one running total.
The total's rounding is that of everything summed before the segment: a segment whose terms
are small beside it (a peaked depth distribution's tail bins, millions of frustum points) comes
out 0, or below 0, where exact arithmetic gives a positive sum, and a ``log`` or ``sqrt`` of
it is then -inf or NaN. The generic advice for a rounding past a domain edge (a stable
variance formula) misses the form: sum each segment directly. Only for a forward or loss
origin at a log, root or division: one forward re-run follows the cumsum's entries (through
views, slices, indexing, casts) into a difference, and that difference (through a ``cat``
with the first entry, slices, casts) into the op at the origin's line.
"""

from __future__ import annotations

import torch

from .compat import TorchDispatchMode, tree_leaves
from .dispatch import run_op
from .memo import TensorSet
from .source import user_source

# ops that pick entries of a tensor or pass them on unchanged (a view, a slice, an index, a cast)
_PICK = {"view", "_unsafe_view", "reshape", "transpose", "permute", "select", "slice", "index",
         "index_select", "gather", "unsqueeze", "squeeze", "expand", "clone", "contiguous",
         "_to_copy", "alias", "narrow", "flatten", "unflatten", "t", "unbind", "split",
         "split_with_sizes", "chunk"}
_EDGE_OPS = {"aten.log", "aten.log2", "aten.log10", "aten.sqrt", "aten.rsqrt", "aten.div",
             "aten.reciprocal", "aten.pow"}


class _Following(TorchDispatchMode):
    """Marks a cumsum's entries (``sums``) and the differences of them (``diffs``);
    ``found``: the cumsum's line once the op at ``at`` (op, line) took such a difference and
    made a non-finite value."""

    def __init__(self, at: tuple[str, str]):
        super().__init__()
        self.at, self.sums, self.diffs = at, TensorSet(), TensorSet()
        self.lines: dict[int, str | None] = {}
        self.found: str | None = None

    def _mark(self, marks: TensorSet, out, line: str | None) -> None:
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                marks.add(t)
                self.lines[id(t)] = line

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = run_op(func, args, kwargs or {})
        if self.found is None:
            self._see(func.overloadpacket.__name__, args, out)
        return out

    def _see(self, name: str, args, out) -> None:
        first = args[0] if args else None
        tensors = [t for t in tree_leaves(args[:2]) if isinstance(t, torch.Tensor)]
        if name == "cumsum" and isinstance(first, torch.Tensor) and first.is_floating_point():
            self._mark(self.sums, out, user_source())
            return
        summed = [t for t in tensors if t in self.sums]
        diffed = [t for t in tensors if t in self.diffs]
        if name in _PICK and isinstance(first, torch.Tensor) and (first in self.sums
                                                                  or first in self.diffs):
            marks = self.sums if first in self.sums else self.diffs
            self._mark(marks, out, self.lines.get(id(first)))
        elif name in ("sub", "rsub") and len(summed) == 2:
            self._mark(self.diffs, out, self.lines.get(id(summed[0])))
        elif name == "cat" and diffed:  # (the first segment's sum: the total's first entry)
            self._mark(self.diffs, out, self.lines.get(id(diffed[0])))
        elif f"aten.{name}" == self.at[0] and isinstance(first, torch.Tensor) \
                and first in self.diffs and user_source() == self.at[1] \
                and isinstance(out, torch.Tensor) and not bool(torch.isfinite(out).all()):
            self.found = self.lines.get(id(first)) or "?"


def cumsum_diff_hint(runner, hint: str | None, cause: str, hit) -> str | None:
    """``hint`` for an origin ``hit`` (a log, root or division that rounding took to its pole
    or past its domain edge) whose input was a difference of a cumulative sum's entries (see
    the module's docstring): the segment sum's advice, in place of a stable formula's;
    ``hint`` as it is otherwise."""
    if cause not in ("precision", "underflow") or hit is None or hit.source is None \
            or hit.op.rstrip("_") not in _EDGE_OPS:
        return hint
    follow = _Following((hit.op.rstrip("_"), hit.source))
    try:
        runner.run(backward=False, instrument=False, forward_ctx=lambda: follow)
    except Exception:  # (the hint as it is: this only says where the op's input came from)
        return hint
    if follow.found is None:
        return hint
    return (f"{hit.op}'s input is a difference of two entries of a cumulative sum (made at "
            f"{follow.found}): a segment sum by the cumsum trick (LSS's QuickCumsum voxel "
            "pooling, a summed-area table's box sum), exact only in exact arithmetic; the "
            "running total rounds at the size of everything summed before the segment, so a "
            "segment of small terms (a peaked distribution's tail) comes out 0 or below 0 "
            "though each of its terms is positive: sum each segment directly "
            "(x.new_zeros(n, c).index_add_(0, segment_ids, x), scatter_add_, "
            "torch.segment_reduce) or take the cumsum in float64, and floor what the op is "
            "given (clamp_min(eps)) if a segment can be truly empty")
