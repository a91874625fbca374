"""An input event on a loss argument with more rows than the batch, whole rows of it NaN: a
memory bank read before the loop wrote those rows.

DPSH keeps the codes of every training record in a bank ``U`` of shape ``(N, bits)`` beside
their labels ``Y`` (``(N, classes)``), writes the batch's codes into it (``U[idx] =
u.detach()``) and scores the batch against all of it. A bank made with ``torch.empty``
(uninitialised memory) or filled with NaN to mean "not seen yet" holds NaN in every row the
loop has not written during the first epoch, and the loss reads them. The rows are no samples
of the batch (there are more of them than the batch has), and no sharpened target made them
(``replay.shared_loss_arg``'s reading of a target with rows of the loss's own): the rows not
yet written are the ones to name, and the bank's initialisation the fix.
"""

from __future__ import annotations

from typing import Any

import torch

BANK_ROWS = (
    "{tensor} (shape {shape}) has a row per record of the data set, not per sample of the "
    "batch of {batch}: {n} rows, as many as {other}'s (shape {other_shape}), its row(s) {rows} "
    "NaN in every entry and the other {kept} finite, so no sample of the batch is named. It "
    "is read whole, as a memory bank the loop fills batch by batch is (DPSH's code bank U "
    "with its labels Y, a cross-batch memory, a feature queue): rows NaN throughout are "
    "likely rows not written yet, a bank made with torch.empty "
    "(uninitialised memory) or filled with NaN for 'not seen'. Initialise it (torch.zeros, "
    "as DPSH's U = torch.zeros(num_train, bit); random ±1 codes; or a first pass over the "
    "data) or read only the rows written so far (a seen mask)")


def bank_rows_hint(tensor: str, t: torch.Tensor, args: dict[str, Any], batch: int
                   ) -> str | None:
    """The hint for loss argument ``t`` of two or more dims and more rows than the ``batch``,
    as many as another loss argument (its labels), with whole rows NaN and some rows finite;
    None otherwise."""
    if t.dim() < 2 or not batch or t.shape[0] <= batch:
        return None
    other = next((name for name, a in args.items() if name != tensor
                  and isinstance(a, torch.Tensor) and a.dim() >= 1
                  and a.shape[0] == t.shape[0] and bool(torch.isfinite(a).all())), None)
    if other is None:
        return None
    flat = t.detach().flatten(1)
    bad, nan = ~torch.isfinite(flat), torch.isnan(flat)
    rows = bad.any(1)
    if not bool(rows.any()) or bool(rows.all()) or not bool((nan.all(1) == rows).all()):
        return None  # (some entries of a row only, or no row finite: not a bank half written)
    named = rows.nonzero().flatten().tolist()
    return BANK_ROWS.format(tensor=tensor, shape=tuple(t.shape), batch=batch, n=t.shape[0],
                            other=other, other_shape=tuple(args[other].shape),
                            rows=named[:8] + (["..."] if len(named) > 8 else []),
                            kept=int((~rows).sum()))
