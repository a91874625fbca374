"""A pole exactly at the pairs of two point sets that sit at one position.

A docking scorer takes the distances between a ligand's and a pocket's atoms,
``d = torch.cdist(lig_pos, prot_pos)`` ``(B, L, P)``, and a Lennard-Jones ``sigma / d`` or a
unit vector ``vec / d`` of every pair: a pose that put a ligand atom exactly on a pocket atom
(or a file that wrote one atom twice) makes that pair's ``d`` 0 and the op ``x / 0``. Since
the coordinates are data, :mod:`replay.data_factor` said the divisor was a time or a count of
the records (a diffusion time t = 0, a duplicated timestamp), which misleads here. The
self-pairs of one set (the diagonal) are :mod:`replay.self_pairs`'; an edge list's are
:mod:`replay.self_edges`'. :func:`coincident_hint` says, for an ``invalid`` op whose
non-finite entries ``(..., n, m)`` are exactly the pairs ``(i, j)``, ``i != j`` when one set,
at which two float root inputs of coordinates, ``(..., n, k)`` and ``(..., m, k)`` with
``k <= 3``, are equal, that those are two different points at one position, and what to do.
"""

from __future__ import annotations

import torch

from recorder.capture import batch_path

from .data_factor import ADVICE
from .load import Step
from .recorded import n_args

SAID = ("; but its non-finite entries are exactly the pairs of points at one position in "
        "{pairs}: a distance of 0 between two different points (an atom placed on another by "
        "a pose generator or an augmentation, an atom written twice by a format conversion), "
        "no place for an eps: find and drop or repair those records where the coordinates "
        "are made (assert (torch.cdist(a, b) > 0).all() there), or give the pair term a "
        "short-range floor (d.clamp_min(r_min), a soft-core form) if such poses must be "
        "scored")


def coincident_hint(hint: str | None, cause: str | None, hit, step: Step,
                    mb: int) -> str | None:
    """``hint`` with the coordinates named whose coincident pairs are exactly the op's
    non-finite entries (``data_factor``'s advice of a time or a count dropped)."""
    ev = None if hit is None else hit.evidence
    if hint is None or cause != "invalid" or ev is None or ev.bad.dim() < 2 \
            or mb >= len(step.micro_batches) or not bool(ev.bad.any()):
        return hint
    bad = ev.bad.cpu()
    entry = step.micro_batches[mb]
    count = n_args(entry.get("inputs"))
    points = [(batch_path(raw, count), t.detach().cpu())
              for key, raw in (entry.get("paths") or {}).items()
              if _points(t := step.tensors.get(key))]
    for k, (a, ta) in enumerate(points):
        for b, tb in points[k:]:
            same = _same(ta, tb, bad.shape)
            if same is not None and bool(same.any()) and bool(same.eq(bad).all()):
                pairs = a if a == b else f"{a} and {b}"
                return hint.replace(ADVICE, "") + SAID.format(pairs=pairs)
    return hint


def _points(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 2 \
        and 1 <= t.shape[-1] <= 3 and t.shape[-2] >= 1


def _same(a: torch.Tensor, b: torch.Tensor, shape: torch.Size) -> torch.Tensor | None:
    """Where a's point i equals b's point j, ``(..., n, m)``, when that is ``shape`` (the
    diagonal left out where a is b)."""
    if a.shape[-1] != b.shape[-1] or a.shape[:-2] != b.shape[:-2] \
            or tuple(shape) != (*a.shape[:-2], a.shape[-2], b.shape[-2]):
        return None
    same = (a[..., :, None, :] == b[..., None, :, :]).all(-1)
    if a is b or (a.shape == b.shape and torch.equal(a, b)):
        same &= ~torch.eye(a.shape[-2], dtype=torch.bool)
    return same
