"""The ring's norms of a sharded model, of the full tensors: each rank measured its own shards.

Under FSDP2 / tensor parallelism the recorder measures local shards only (a norm of a DTensor
is a collective, ``recorder.shards``), so each rank's ``ring/grad_norm`` is the norm of its own
pieces of the gradients. The replay re-runs the step unsharded and compares its norms with the
ring's: the window took every rank's smaller local norm for the loop's gradient clipping, scaled
the re-run's gradients down to it (training changed) and said "the loop's gradient clipping
re-applied" of a loop that never clipped. Here the set's norms are combined: a parameter's
full norm is the root of the sum of its shards' squares over the ranks, each divided by how
many ranks hold the same piece (its ``Replicate`` mesh dimensions; an unsharded parameter is
on every rank). A norm that cannot be combined so (a ``Partial`` piece, ranks whose rings hold
other steps) becomes NaN: unknown, which the replay's checks skip, rather than wrong.
"""

from __future__ import annotations

import math
from typing import Any

import torch

# (total, per parameter, the bundle's key prefix of the tensors measured)
_NORMS = (("ring/grad_norm", "ring/grad_norms", "grads/"),
          ("ring/param_norm", "ring/param_norms", "weights/"),
          (None, "ring/update_norms", "weights/"))


def full_norms(meta: dict[str, Any], rings: list[dict[str, torch.Tensor]], world: int
               ) -> dict[str, torch.Tensor]:
    """The ring's norm tensors of the full model, from every rank's ``rings`` (their
    tensors) and the replayed rank's ``meta`` (its shard records and parameter names)."""
    base, out = rings[0], {}
    steps = base.get("ring/steps")
    same = steps is not None and all(
        r.get("ring/steps") is not None and torch.equal(r["ring/steps"], steps) for r in rings)
    for total, each, prefix in _NORMS:
        copies = [_copies(meta, prefix + n, world) for n in meta.get("params") or []]
        if each in base:
            out[each] = _combined([r.get(each) for r in rings], same, copies)
        if total is None or total not in base:
            continue
        one = set(copies) if None not in copies else set()
        if len(one) == 1:  # (every parameter on as many ranks: the totals combine alike)
            out[total] = _combined([r.get(total) for r in rings], same, one.pop())
        elif each in out and out[each].shape[-1] == len(copies):
            out[total] = out[each].double().pow(2).sum(-1).sqrt().to(base[total].dtype)
        else:
            out[total] = torch.full_like(base[total], math.nan)
    return out


def _copies(meta: dict[str, Any], key: str, world: int) -> int | None:
    """On how many ranks each piece of tensor ``key`` lies; None for a Partial piece."""
    where = (meta.get("shards") or {}).get(key)
    if where is None:
        return world  # (not sharded: a full copy on every rank)
    n = 1
    for size, p in zip(where.get("mesh") or [], where.get("placements") or []):
        if "partial" in p:
            return None
        if "replicate" in p:
            n *= int(size)
    return n


def _combined(pieces: list[torch.Tensor | None], same: bool, copies) -> torch.Tensor:
    """sqrt(sum over ranks of piece^2 / copies); NaN where that is unknown."""
    base = pieces[0]
    if not same or any(p is None or p.shape != base.shape for p in pieces):
        return torch.full_like(base, math.nan)
    sq = sum(p.double().pow(2) for p in pieces)
    if isinstance(copies, list):
        if len(copies) != base.shape[-1]:
            return torch.full_like(base, math.nan)
        div = torch.tensor([math.nan if c is None else float(c) for c in copies],
                           dtype=torch.float64)
    else:
        div = torch.tensor(float(copies), dtype=torch.float64)
    return (sq / div).sqrt().to(base.dtype)
