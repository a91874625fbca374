"""NaN of -inf - -inf where one operand's whole row is masked: a hand-written softmax's
``x - x.max()``, or sparsemax / entmax's ``z - tau`` whose threshold ``tau = (cumsum - 1) / k``
is -inf because the support size ``k`` of a row of -inf is 0. The mask is fine entry by entry;
the row has nothing kept, which asks for another fix than a masked pair of entries."""

from __future__ import annotations

import torch

from .hits import OpHit

# (given, what to do) for MASK_ARITH's place in replay.cause._from_infinities
FULLY_MASKED = ("infinities", " on rows whose every entry is masked (-inf): a softmax, "
                "sparsemax or entmax written by hand shifts each row by its max or its "
                "threshold tau = (cumsum - 1) / k, which on such a row is -inf too (support "
                "size k = 0), and x - tau is -inf - -inf: keep at least one unmasked entry per "
                "row, or skip the fully masked rows (compute on the rows with any kept entry "
                "and give the others 0); a finite fill (torch.finfo(dtype).min) fixes a "
                "softmax's max shift but not a sparsemax, whose cumsum overflows to -inf")


def mark(hit: OpHit, from_mask: bool, ins: list[torch.Tensor], out: torch.Tensor) -> None:
    """Set ``hit.from_mask``, and ``hit.row_masked`` when an operand of ``out``'s shape is -inf
    in every entry of the last-dim rows where ``out`` is NaN."""
    hit.from_mask = from_mask
    if not from_mask or out.dim() == 0 or out.shape[-1] < 2:
        return
    bad = torch.isnan(out.detach())
    rows = bad.any(-1)
    for t in ins:
        if t.shape != out.shape or not t.is_floating_point():
            continue
        masked = (t.detach() == float("-inf")).all(-1)
        if bool(rows.any()) and bool(masked[rows].all()):
            hit.row_masked = True
            return


def advice(hit: OpHit) -> tuple[str, str] | None:
    """What :data:`FULLY_MASKED` says, where ``hit`` made NaN on fully masked rows."""
    return FULLY_MASKED if hit.row_masked else None
