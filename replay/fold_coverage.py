"""A 0/0 by ``nn.Fold``'s overlap count at pixels no patch covers.

Patch-based code (an inpainting or denoising autoencoder over overlapping patches, a ViT's
patch reconstruction) averages the folded patches by how many cover each pixel,
``fold(patches) / fold(unfold(ones))``. Where the kernel, stride and padding leave the last
rows or columns of the size Fold is given uncovered (``(size + 2 * padding - kernel) % stride
!= 0``: a 3x3 kernel at stride 2 over 8 pixels reaches pixel 6), both are 0 there, in every
image of that size: no sample is to blame, and an eps makes those pixels 0 in silence.
:class:`FoldCoverage` (fed by :class:`~replay.lineage.Lineage`) marks ``col2im``'s outputs and
finds the division by one at its zeros; :func:`with_fold_coverage` then says which rows and
columns are uncovered and why.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .memo import TensorMarks

_DIVS = {"div", "div_", "true_divide", "reciprocal"}
_CARRY = {"view", "reshape", "_unsafe_view", "clone", "contiguous", "expand", "_to_copy",
          "detach", "alias"}


class Uncovered(NamedTuple):
    size: tuple[int, int]
    kernel: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    lines: tuple[list[int], list[int]]  # the uncovered rows, columns


class FoldCoverage:
    def __init__(self):
        self._folded = TensorMarks()  # col2im's outputs (and views of them): its settings
        self.found: Uncovered | None = None

    def track(self, name: str, args, out) -> None:
        if self.found is not None or not args or not isinstance(out, torch.Tensor):
            return
        x = args[0]
        if name == "col2im" and len(args) >= 6:
            self._folded.put(out, tuple(tuple(a) if isinstance(a, (list, tuple)) else (a, a)
                                        for a in args[1:6]))
        elif name in _CARRY and isinstance(x, torch.Tensor) and self._folded.get(x) \
                and out.shape[-2:] == x.shape[-2:]:
            self._folded.put(out, self._folded.get(x))
        elif name.rstrip("_") in _DIVS:
            d = args[0 if name == "reciprocal" else 1] if len(args) > 1 or name == "reciprocal" \
                else None
            if isinstance(d, torch.Tensor) and d.dim() >= 2 and self._folded.get(d):
                self._check(d, out)

    def _check(self, d: torch.Tensor, out: torch.Tensor) -> None:
        settings = self._folded.get(d)
        zero = (d == 0).reshape(-1, *d.shape[-2:]).all(0)  # 0 in every image and channel
        if not settings or not bool(zero.any()) or bool(torch.isfinite(out).all()):
            return
        size, kernel, _dilation, padding, stride = settings
        rows = torch.nonzero(zero.all(1)).flatten().tolist()
        cols = torch.nonzero(zero.all(0)).flatten().tolist()
        self.found = Uncovered(size, kernel, stride, padding, (rows, cols))


def with_fold_coverage(hint: str | None, cause: str | None, hit,
                       watch: FoldCoverage | None) -> str | None:
    """``hint``, for a 0/0 by a folded overlap count, with the uncovered pixels and the fix."""
    found = watch and watch.found
    if hint is None or not found or cause != "invalid" or hit is None \
            or hit.op.removeprefix("aten.").rstrip("_") not in _DIVS:
        return hint
    (h, w), (kh, kw), (sh, sw), (ph, pw) = found.size, found.kernel, found.stride, found.padding
    rows, cols = found.lines
    where = " and ".join(part for part in (
        f"row(s) {rows[:8]}" if rows else "", f"column(s) {cols[:8]}" if cols else "") if part)
    return (f"{hint}; but here the divisor is nn.Fold's sum of overlapping patches (col2im: an "
            "overlap count, fold(unfold(ones))), 0 at the pixels no patch covers: kernel "
            f"{kh}x{kw} at stride {sh}x{sw} with padding {ph}x{pw} over an output of {h}x{w} "
            f"leaves {where or 'some pixels'} uncovered ((size + 2 * padding - kernel) % stride != 0), "
            "in every image of that size, so no sample is to blame and an eps would make those "
            "pixels 0 in silence: pad the input to a size the patches tile exactly (F.pad to "
            "the next size where (size + 2 * padding - kernel) is a multiple of stride, crop "
            "after folding), or pick a stride that divides size - kernel")
