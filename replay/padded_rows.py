"""The samples of a loss's op on the batch's data that went non-finite at real entries, not at
the padding a mask among the loss's arguments marks.

BLP's inversion ``log(s_j) - log(s_0)`` of markets padded to ``J`` products: the padding's
shares are 0, so the log is -inf at every padded product, and ``torch.where(mask, v - delta,
0)`` drops those entries by design. A market whose observed share of a real product is 0 (a
product nobody bought there) goes non-finite too, and only its -inf reaches the loss. The op's
non-finite rows name every market with padding; :func:`unpadded_rows` keeps the rows whose
non-finite entries are not all padding by a padding mask (:func:`replay.padded_zeros.
padding_masks`: 0/1, each row's 1s then its 0s) laid over the op's output, where some are
padding and some are not (all padding: the op taken at the padding is the bug, left to
:mod:`replay.raw_pole`).
"""

from __future__ import annotations

from typing import Any

from .padded_zeros import aligned, padding_masks


def unpadded_rows(hit: Any, args: tuple, kwargs: dict) -> list[int] | None:
    """Rows (dim 0) of ``hit``'s non-finite output entries at a padding mask's True entries,
    when the op took the data alone and others of its non-finite entries are padding; None
    when no such mask splits them."""
    ev = getattr(hit, "evidence", None)
    if ev is None or not ev.of_data or ev.bad.dim() < 2:
        return None
    named = {f"args[{i}]": a for i, a in enumerate(args)}
    named.update({k: v for k, v in kwargs.items()})
    bad = ev.bad.detach().cpu()
    for _, mask in padding_masks(named):
        laid = aligned(mask.cpu(), bad.shape)
        if laid is None:
            continue
        real = bad & laid
        if bool(real.any()) and bool((bad & ~laid).any()):
            return sorted({int(r) for r in real.nonzero()[:, 0]})
    return None
