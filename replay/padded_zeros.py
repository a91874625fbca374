"""A pole op on the batch's own values whose 0s there are all padding by a mask the model is
given: the entries a collate_fn filled with 0 to pad variable-length sets to one size.

ParticleNet's input features ``log(pT)``, ``log(E)`` of a jet padded to ``P`` particles, then
multiplied by the particle mask: the padded particles' four-momenta are 0, the log is -inf
there and ``-inf * 0`` is NaN. :func:`~replay.raw_pole.raw_pole_hint` would call each padded
jet a bad record (a 0 where the data should hold none) and say to repair the dataset; nothing
is wrong with the data: the padding is meant, and the op must not be taken there (a mask
multiplied in after the op cannot undo its infinity). :func:`padding_mask` finds the mask
among the root call's 0/1 tensors (some entries 0, some 1) whose 0s cover every entry where
the op went non-finite at a 0 of its input, and :func:`padded_hint` says so.
"""

from __future__ import annotations

import torch

from recorder.finite import zero_one


def padding_masks(named: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The tensors of ``named`` (the root call's, by argument name) that are 0/1 masks with
    both values, laid out as padding: along their last dim of more than one entry, each row's
    1s first, then its 0s (a set padded at its end; not a nodata mask's scattered 0s)."""
    out = []
    for name, t in named.items():
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.is_nested \
                or t.is_complex() or t.numel() < 2 \
                or not (t.dtype == torch.bool or t.is_floating_point()):
            continue
        on = t.bool() if t.dtype == torch.bool else t
        if t.dtype != torch.bool and not zero_one(t):
            continue
        if bool(on.any()) and not bool(on.all()) and _trailing(on.bool()):
            out.append((name, t.detach()))
    return out


def _trailing(on: torch.Tensor) -> bool:
    """Along ``on``'s last dim of size > 1, no 1 follows a 0 (each row: real, then padding)."""
    dims = [d for d, s in enumerate(on.shape) if s > 1]
    if not dims:
        return False
    rows = on.movedim(dims[-1], -1).to(torch.int8)
    return not bool((rows[..., 1:] > rows[..., :-1]).any())


def aligned(mask: torch.Tensor, shape: torch.Size) -> torch.Tensor | None:
    """``mask`` laid over a tensor of ``shape``: the same entries (its size-1 dims dropped:
    a mask ``(B, 1, P)`` over ``(B, P)``), or its dims a leading part of the shape, broadcast
    over the rest (a particle mask ``(B, P)`` over features ``(B, P, F)``); else None."""
    m = mask.bool()
    kept = [s for s in m.shape if s != 1]
    if kept == [s for s in shape if s != 1]:
        return m.reshape(shape)
    if len(m.shape) < len(shape) and tuple(m.shape) == tuple(shape[:m.dim()]):
        return m.reshape(*m.shape, *([1] * (len(shape) - m.dim()))).expand(shape)
    return None


def padding_mask(at_zero: torch.Tensor, masks: list[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first of ``masks`` that is 0 (False) at every True entry of
    ``at_zero`` (where the op went non-finite at its input's 0); None if none is."""
    for name, m in masks:
        laid = aligned(m, at_zero.shape)
        if laid is not None and bool(at_zero.any()) and not bool((at_zero & laid).any()):
            return name
    return None


def padded_hint(op: str, what: str, mask: str) -> str:
    """The hint for ``op`` whose 0s (``what``: 'of 0: its input', 'by 0: its divisor') are
    the batch's padding by ``mask``."""
    return (f"{op} {what} is the batch's own data, exactly 0 where it went non-finite, and "
            f"every such entry is padding by {mask} (its 0/False entries: the elements a "
            "collate_fn added to pad each sample's set or sequence to one length): no record "
            "is bad, the op was taken at the padding too; a mask multiplied in after the op "
            "cannot undo it (-inf * 0 and inf * 0 are NaN). Keep the padding out of the op: "
            "replace it first (torch.where(mask.bool(), x, 1), x.clamp_min(eps)) or compute "
            "the op on the real elements only (x[mask]), then mask the result")
