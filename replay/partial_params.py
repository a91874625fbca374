"""Parameters the loop's own update made non-finite in whole slices only, beside others non-finite
throughout.

Lee & Seung's multiplicative updates written in ``no_grad`` (``H *= (W^T V) / (W^T W H)``, then
``W *= (V H^T) / (W H H^T)``) with no eps: an item no one rated (a column of V all 0) makes its
column of H exactly 0 at one update and 0/0 at the next, and W's update, a product with all of
H, is then NaN everywhere. Every element non-finite is the mark of a bad coefficient (an EMA's
momentum); whole slices of one parameter are that of an element-wise division by 0 there, and
they name the data's slice (the item) that made it.
"""

from __future__ import annotations

import torch

SHOWN = 8


def slices_text(t: torch.Tensor) -> str:
    """``t``'s non-finite entries as whole slices along one dim ("along dim 1: 6"), or their
    count when they fill no whole slice."""
    bad = ~torch.isfinite(t)
    n = int(bad.sum())
    for d in range(t.dim()) if t.dim() >= 2 else ():
        x = bad.movedim(d, 0).reshape(t.shape[d], -1)
        full, some = x.all(1), x.any(1)
        if bool(some.any()) and torch.equal(full, some):
            idx = full.nonzero().flatten().tolist()
            more = f" (+{len(idx) - SHOWN})" if len(idx) > SHOWN else ""
            return f"{n} of {t.numel()}, whole slices along dim {d}: " \
                   + ", ".join(map(str, idx[:SHOWN])) + more
    return f"{n} of {t.numel()}"


def partial_hint(tensors: dict[str, torch.Tensor]) -> str:
    """The text for parameters (name: bundle tensor) of which some are non-finite only in part
    ("" when none is, or all are)."""
    partial = {n: t for n, t in tensors.items() if bool(torch.isfinite(t).any())}
    if not partial:
        return ""
    said = "; ".join(f"{n}: {slices_text(t)}" for n, t in partial.items())
    whole = [n for n in tensors if n not in partial]
    spread = (f", and {', '.join(whole)} non-finite throughout, as a product with them "
              "spreads it" if whole else "")
    return (f". Only some elements are non-finite ({said}){spread}: an element-wise update "
            "that divides made them (a multiplicative update's num / den without an eps, 0/0 "
            "where a slice of the data is all 0, an item no one rated or an empty document, "
            "and the factor's slice with it): add an eps to the denominator, or skip those "
            "slices")
