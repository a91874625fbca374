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

DeepHash-pytorch's ``DPSHLoss`` holds the bank itself (``self.U``, ``self.Y``: plain tensors of
the loss) and writes the batch's rows in ``forward`` (``self.U[ind] = u.data``): the op that
takes the NaN is that row write, and the loss's own tensor holds it as the step began.
:func:`held_bank_hint` names that bank instead of a value made before the step (class weights
of an absent class).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

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


# in-place writes of rows of a tensor (``bank[ind] = rows``)
ROW_WRITES = {"aten.index_put_", "aten.index_put", "aten.index_copy_", "aten.index_copy",
              "aten.scatter_", "aten.masked_scatter_"}

HELD_BANK = (
    "{op} writes rows of the loss's {name!r} (shape {shape}), a table the loss keeps with a "
    "row per record of the data set and reads whole, as a memory bank is (DeepHash-pytorch's "
    "DPSHLoss keeps every training code in self.U, written in forward: self.U[ind] = "
    "u.data): {bad} of its {n} rows are NaN in every entry ({rows}), rows not written yet "
    "where the bank was made with torch.empty or filled with NaN for 'not seen', and an op "
    "reading the whole bank (u @ self.U.t()) takes them into every sample's loss. Initialise "
    "it finite (torch.zeros(num_train, bit), as DeepHash-pytorch does; random ±1 codes) or "
    "read only the rows written so far (a seen mask)")


def held_bank_hint(op: str, loss_fn: Any) -> str | None:
    """The hint when loss op ``op`` is a row write into a tensor of the loss module
    ``loss_fn`` (a buffer or plain tensor attribute of two or more dims) whose non-finite
    entries fill whole rows of NaN; None otherwise."""
    if op not in ROW_WRITES or not isinstance(loss_fn, nn.Module):
        return None
    own = [*loss_fn.named_buffers()]
    own += [(k, v) for k, v in vars(loss_fn).items() if isinstance(v, torch.Tensor)]
    for name, t in own:
        if t.dim() < 2 or not t.is_floating_point():
            continue
        flat = t.detach().flatten(1)
        rows = (~torch.isfinite(flat)).any(1)
        if not bool(rows.any()):
            continue
        if not bool((torch.isnan(flat).all(1) == rows).all()):
            return None  # (some entries of a row only: no bank's unwritten row)
        named = rows.nonzero().flatten().tolist()
        return HELD_BANK.format(op=op, name=name, shape=tuple(t.shape), bad=len(named),
                                n=t.shape[0],
                                rows=named[:8] + (["..."] if len(named) > 8 else []))
    return None
