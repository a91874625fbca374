"""A channel of real-valued data that reads exactly 0 throughout the samples of a 0/0.

Calcium imaging's dF/F, ``(F - F0) / F0`` with F0 a rolling percentile baseline of each ROI,
is 0/0 for a ROI that reads 0 all trial (a cell that drifted out of the field of view, masked
by motion correction); a per-electrode z-score of an EEG or a spike-sorted array is 0/0 for an
electrode that was disconnected in one recording. The op's advice (an eps in the denominator)
is one fix; the hint adds which channel of which tensor is dead in the named samples while
every other sample's same channel holds a signal, so the user sees the dead sensor and can
mask or drop it where the data is made. The channel is looked for in each dim after the
samples' (ROIs last, ``(B, T, R)``, or first, ``(B, C, T)``), all 0 over every other dim;
0/1 data is :mod:`replay.absent_channels`', samples all 0 everywhere
:mod:`replay.zero_records`'. The loss's real-valued data arguments are read too: a shot
gather given as the target of a normalized cross-correlation, ``obs / obs.norm(dim=1)``, is
0/0 at a receiver that recorded nothing (a dead geophone's trace of zeros).
"""

from __future__ import annotations

from typing import Any

import torch

from recorder.finite import zero_one

from .drop import undroppable
from .empty_records import batch_data
from .load import Step

_DIVIDING = {"aten.div", "aten.div_", "aten.reciprocal"}
_SAID = (" records: ", "hold no entry of", "Sample(s) ", "sample(s) ")  # (the data named)


def dead_channels_hint(report: dict[str, Any], step: Step) -> None:
    """Append the real-valued model inputs' and loss data's channels all 0 in exactly the
    samples of a 0/0 (a target's empty class is 0/1 data, a label, no dead sensor: left to
    :mod:`replay.absent_channels`)."""
    o, hint = report.get("origin") or {}, report.get("hint") or ""
    rows, mb = o.get("samples") or [], o.get("micro_batch") or 0
    if report.get("cause") != "invalid" or o.get("op") not in _DIVIDING or not rows \
            or o.get("all_samples") or "0 by 0" not in hint or any(s in hint for s in _SAID):
        return
    found = [(name, dim, cs) for name, t, d in batch_data(step, mb)
             for dim, cs in dead_channels_of(t, d, rows)]
    if not found:
        return
    which = ",".join(str(r) for r in rows)
    said = " and ".join(f"channel(s) {', '.join(map(str, cs))} (dim {dim}) of {name}"
                        for name, dim, cs in found)
    how = (f" (--try drop={which} re-runs the step without them)"
           if undroppable(step, mb) is None else "")
    report["hint"] = (
        f"{hint}. Sample(s) {which} read exactly 0 throughout {said} while every other "
        "sample's same channel holds a signal: a dead channel of the record (a ROI out of the "
        "field of view, an electrode disconnected, a sensor that dropped out, a dead "
        "receiver's trace of zeros), which a "
        "per-channel normalisation by its own baseline, spread or energy (dF/F = (F - F0) / "
        "F0, a z-score, a trace over its norm) makes 0/0; mask or drop such channels where the data is made (a validity "
        "mask per channel and record), or floor the denominator (F0.clamp_min(eps)) so they "
        f"read 0{how}")


def dead_channels_of(t: torch.Tensor, d: int, rows: list[int]) -> list[tuple[int, list[int]]]:
    """(dim, channels) of real-valued ``t`` (samples in dim ``d``) all 0 over every other dim
    in each of ``rows`` and in no other sample, where each of ``rows`` holds a nonzero
    value elsewhere (not a blank record); each dim after ``d`` with at least 2 entries."""
    if not t.is_floating_point() or t.dim() < d + 3 or max(rows) >= t.shape[d] \
            or len(rows) >= t.shape[d] or zero_one(t):
        return []
    x = t.detach().movedim(d, 0)
    named = torch.zeros(x.shape[0], dtype=torch.bool)
    named[rows] = True
    if not bool(x[named].reshape(int(named.sum()), -1).ne(0).any(1).all()):
        return []  # (a sample blank everywhere: replay.zero_records)
    out = []
    for dim in range(1, x.dim()):
        if x.shape[dim] < 2:
            continue
        live = x.movedim(dim, 1).reshape(x.shape[0], x.shape[dim], -1).ne(0).any(2)
        dead = ~live
        hit = dead[named].any(0) & ~dead[~named].any(0)  # (dead in some named, in no other)
        cover = (dead[named] & hit).any(1).all()  # (every named sample has one)
        if bool(hit.any()) and bool(cover) and not _padded(dead[named]):
            out.append((dim - 1 if dim <= d else dim, torch.nonzero(hit).flatten().tolist()))
    return out


def _padded(dead: torch.Tensor) -> bool:
    """Whether some sample's dead entries ``dead[i]`` are a run of 2 or more at an end of the
    dim: a shorter sequence's padding (time steps), not a dead channel."""
    for row in dead:
        n = int(row.sum())
        if n >= 2 and (bool(row[:n].all()) or bool(row[-n:].all())):
            return True
    return False
