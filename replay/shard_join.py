"""One distributed event's bundles put together into the step to replay: the first rank's
bundle, with full tensors where the ranks hold shards (:mod:`replay.shards` finds the set from
the headers alone, without torch, for ``--info`` and ``--strip``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from recorder.bundle import read_bundle
from recorder.errors import BundleError

from .shard_norms import full_norms
from .shards import missing, ranks_of, shard_set


def resolve(path: Path, meta: dict[str, Any], tensors: dict[str, torch.Tensor],
            check_meta: Callable[[dict[str, Any], Path], None], rank: int | None = None
            ) -> tuple[Path, dict[str, Any], dict[str, torch.Tensor]]:
    """What to replay for ``path``: itself when it is no distributed event's bundle; else the
    bundle of the first rank to see the event (``rank``: that one of several first ranks),
    with full tensors where the ranks hold shards. A shard set with a rank missing is a
    :class:`BundleError` naming the ranks found and missing. ``check_meta`` checks each
    sibling's metadata as the given bundle's was (``replay.load``, which calls this)."""
    ranks = ranks_of(meta)
    if ranks is None:
        return path, meta, tensors
    first = rank if rank is not None else min(ranks.get("first") or [ranks["rank"]])
    if "shards" not in meta:  # DDP: every rank holds the full model; replay the first one
        if first == ranks["rank"]:
            return path, meta, tensors
        other = shard_set(path, meta).get(first)
        if other is None:
            if meta["event"].get("phase") != "peer":
                return path, meta, tensors  # this rank's own event: replayable as it is
            raise BundleError(
                f"{path}: rank {ranks['rank']}'s own values were finite at step "
                f"{meta['event'].get('step')}; rank(s) {ranks.get('first')} saw the event "
                f"first, and no bundle of rank {first} of run {ranks['run_id']} is beside it: "
                f"copy it into {path.parent}, or replay it directly")
        m, t = read_bundle(other)
        check_meta(m, other)
        return other, m, t
    found = shard_set(path, meta)
    if len(found) < int(ranks["world_size"]):
        raise missing(path, meta, found)
    bundles = {r: (meta, tensors) if p == path else read_bundle(p) for r, p in found.items()}
    for r, p in found.items():
        check_meta(bundles[r][0], p)
    base_meta, base = bundles[first]
    full = dict(base)
    for key in base_meta["shards"]:
        full[key] = _assemble(key, {r: (m.get("shards", {}).get(key), t.get(key))
                                    for r, (m, t) in bundles.items()}, found)
    # (each rank's ring measured its own shards: the full model's norms from all of them)
    full.update(full_norms(base_meta, [bundles[first][1], *(t for r, (_, t) in
                                       sorted(bundles.items()) if r != first)],
                           int(ranks["world_size"])))
    out = {k: v for k, v in base_meta.items() if k != "shards"}
    out["shard_set"] = {"ranks": {str(r): str(p) for r, p in sorted(found.items())},
                        "replayed_rank": first, "assembled": len(base_meta["shards"])}
    return found[first], out, full


def _assemble(key: str, pieces: dict[int, tuple[dict | None, torch.Tensor | None]],
              found: dict[int, Path]) -> torch.Tensor:
    """The full tensor ``key`` from every rank's local shard and its offset; a ``Partial``
    tensor's pieces (summands) are added up."""
    full = written = None
    for r, (where, t) in sorted(pieces.items()):
        if where is None or t is None:
            raise BundleError(f"{found[r]}: tensor {key!r} is missing from rank {r}'s shards; "
                              "the bundles are not one set: re-record")
        summed = _summed(key, where, found[r])
        if full is None:
            full = torch.zeros(where["global_shape"], dtype=t.dtype)
            written = torch.zeros(where["global_shape"], dtype=torch.bool)
        if list(t.shape) != where["local_shape"]:
            raise BundleError(f"{found[r]}: tensor {key!r} has shape {list(t.shape)}, its shard "
                              f"record says {where['local_shape']}: the bundle is corrupted")
        region = tuple(slice(o, o + n) for o, n in zip(where["offset"], where["local_shape"]))
        if summed:
            full[region] += t
        else:
            full[region] = t
        written[region] = True
    if full is not None and not bool(written.all()):
        raise BundleError(f"tensor {key!r}: the shards of ranks {sorted(pieces)} do not cover "
                          "its full shape; the bundles are not one set: re-record")
    if full is not None and any(p.get("partial") == "avg" for p in where["placements"]):
        full /= len(pieces)
    return full


def _summed(key: str, where: dict[str, Any], path: Path) -> bool:
    """Whether the piece is a summand (``Partial`` sum or avg over a mesh of no replicas),
    else a shard or replica; any other placement cannot be put back together."""
    kinds = [next(iter(p)) for p in where["placements"]]
    partial = {p.get("partial") for p in where["placements"]} - {None}
    if "other" in kinds or partial - {"sum", "avg"} or (partial and "replicate" in kinds):
        raise BundleError(f"{path}: tensor {key!r} has placement {where['placements']}, which "
                          "cannot be put back together (only Shard, Replicate, and a Partial "
                          "sum or average over no replicas)")
    return bool(partial)
