"""Whether an op folded a non-finite input into its result (a reduction: the result's
samples are those of the inputs it took in) or only picked elements of it as they are (a
view, an index, a gather: no reduction, whatever its size)."""

from __future__ import annotations

import torch

from recorder.finite import pair_ok

from .cause_text import GROUP_REDUCTIONS
from .compat import returns_view

# ops that pick elements of their input as they are: a smaller output holding its -inf folds
# nothing (a row of a masked transition matrix, its entries at the gold tags)
_PICKS = frozenset({"index", "_unsafe_index", "index_select", "gather", "take", "masked_select",
                    "take_along_dim", "embedding"})


def folds(func, out: torch.Tensor, pairs, ins) -> bool:
    """The op reduced a non-finite input into a smaller output (a logsumexp of a -inf row), or
    reduces groups into rows (a row no element lands in keeps the value it started from); not
    a view (``select``, a slice) or another op picking elements as they are."""
    name = func.overloadpacket.__name__.rstrip("_")
    if name in GROUP_REDUCTIONS:
        return True
    if name in _PICKS or returns_view(func):
        return False
    return out.numel() < max(t.numel() for (a, b), t in zip(pairs, ins) if not pair_ok(a, b))
