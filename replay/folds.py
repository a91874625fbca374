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
# ops that read only their tensor argument's shape, dtype and device, never its values: a
# lattice's ``alpha.new_full((b, 1), -inf)`` beside an alpha holding -inf folds nothing in
_METADATA = frozenset({"new_full", "new_zeros", "new_ones", "new_empty", "new_empty_strided",
                       "full_like", "zeros_like", "ones_like", "empty_like", "rand_like",
                       "randn_like", "randint_like"})


def folds(func, out: torch.Tensor, pairs, ins) -> bool:
    """The op reduced a non-finite input into a smaller output (a logsumexp of a -inf row), or
    reduces groups into rows (a row no element lands in keeps the value it started from); not
    a view (``select``, a slice) or another op picking elements as they are."""
    name = func.overloadpacket.__name__.rstrip("_")
    if name in GROUP_REDUCTIONS:
        return True
    if name in _PICKS or name in _METADATA or returns_view(func):
        return False
    return out.numel() < max(t.numel() for (a, b), t in zip(pairs, ins) if not pair_ok(a, b))


# nll_loss and its 2-d form take one entry of each row, at the row's target: a row whose other
# entries are -inf (classes masked out) folds no infinity in
_AT_TARGET = frozenset({"nll_loss_forward", "nll_loss2d_forward"})


def folded_inputs(func, args, ins: list[torch.Tensor], pairs, moved=None) -> list[torch.Tensor]:
    """The non-finite inputs a reduction folded in; for nll_loss, the entries it took at the
    targets (0 where a row's target is ignore_index or has weight 0), whose rows are the samples
    whose loss is non-finite (in the rows of its input: ``moved`` follows them where a view
    merged the samples with the steps after them, a decoder's ``log_p.flatten(0, 1)``)."""
    bad = [t for t, (a, b) in zip(ins, pairs) if not pair_ok(a, b)]
    if func.overloadpacket.__name__ not in _AT_TARGET or len(args) < 5:
        return bad
    x, target, weight, _, ignore = args[:5]
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or target.dim() != x.dim() - 1:
        return bad
    with torch.no_grad():
        at = target.clamp(0, x.shape[1] - 1)
        taken = x.detach().gather(1, at.unsqueeze(1)).squeeze(1)
        skip = target == ignore
        if isinstance(weight, torch.Tensor):
            skip = skip | (weight[at] == 0)
        taken = taken.masked_fill(skip, 0.0)
    if moved is not None:
        moved.same_rows(x, taken)
    return [taken]
