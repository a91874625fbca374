"""The bundles of one distributed event: siblings, the rank to replay, full tensors from shards.

Under ``torch.distributed`` every rank writes its own bundle of the step at which the ranks
agreed on an event (``recorder.ranks``), with the run id, the ranks that saw it first and, under
FSDP2, its local shards (``meta["shards"]``, see ``recorder.shards``). Given any one of them,
the replay reads the bundles beside it with the same run id and step (whatever their file
names), puts every sharded weight, gradient and optimizer state back together, and replays the
rank that saw the event first, unsharded, in one process.

>>> ranks = shard_set(Path("nan-bundles/step00000003-rank0.nan"))   # doctest: +SKIP
>>> {r: p.name for r, p in ranks.items()}                            # doctest: +SKIP
{0: 'step00000003-rank0.nan', 1: 'step00000003-rank1.nan'}
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from recorder.bundle import BundleReader, read_bundle
from recorder.errors import BundleError


def ranks_of(meta: dict[str, Any]) -> dict[str, Any] | None:
    """The event's rank agreement (run id, rank, world size, first, seen_by), if any."""
    ranks = (meta.get("event") or {}).get("ranks")
    return ranks if isinstance(ranks, dict) and isinstance(ranks.get("run_id"), str) else None


def shard_set(path: Path, meta: dict[str, Any] | None = None) -> dict[int, Path]:
    """Rank -> bundle of the same run id and step as ``path``, from the ``.nan`` files beside
    it (headers only). ``{}`` for a bundle of no distributed event."""
    if meta is None:
        with BundleReader(path) as r:
            meta = r.meta
    mine = ranks_of(meta)
    if mine is None:
        return {}
    step = meta["event"].get("step")
    found = {int(mine["rank"]): path}
    for other in sorted(path.parent.glob("*.nan")):
        if other.resolve() == path.resolve():
            continue
        try:  # (a peer cut short is still one of the set: reading its tensors says so)
            with BundleReader(other, whole=False) as r:
                m = r.meta
        except BundleError:  # another file that is no bundle: not one of the set
            continue
        theirs = ranks_of(m)
        if theirs and theirs["run_id"] == mine["run_id"] and m["event"].get("step") == step:
            found.setdefault(int(theirs["rank"]), other)
    return found


def missing(path: Path, meta: dict[str, Any], found: dict[int, Path]) -> BundleError:
    ranks = ranks_of(meta)
    world = int(ranks["world_size"])
    lost = [r for r in range(world) if r not in found]
    alone = (" (the step was cut short by an exception and checked on rank "
             f"{ranks['rank']} alone: a rank that did not raise there wrote none, and without "
             "its shards the model cannot be put back together)") if ranks.get("alone") else ""
    return BundleError(
        f"{path}: this bundle is one of {world} ranks' shards of run {ranks['run_id']} step "
        f"{meta['event'].get('step')}; found rank(s) {sorted(found)} beside it, missing rank(s) "
        f"{lost}: copy every rank's bundle of that step into {path.parent}{alone}")


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


def describe(path: Path, meta: dict[str, Any]) -> dict[str, Any] | None:
    """For ``--info``: the set this bundle belongs to (headers only), or None."""
    ranks = ranks_of(meta)
    if ranks is None:
        return None
    found = shard_set(path, meta)
    world = int(ranks["world_size"])
    return {"run_id": ranks["run_id"], "rank": ranks["rank"], "world_size": world,
            "first": ranks.get("first"), "seen_by": ranks.get("seen_by"),
            "sharded_tensors": len(meta.get("shards", {})),
            "optimizer_shard": _optimizer_shard(meta),
            "found": {str(r): str(p) for r, p in sorted(found.items())},
            "missing": [r for r in range(world) if r not in found]}


def _optimizer_shard(meta: dict[str, Any]) -> dict[str, Any] | None:
    """The optimizer whose inner optimizer holds this rank's shard of the parameters and their
    state (ZeRO-1's, see ``replay.sharded_optim``): its class, and how many it holds of all."""
    opt = meta.get("optimizer") or {}
    for d in (opt.get("inner") or {}).values():
        if isinstance(d, dict) and d.get("sharded"):
            return {"class": str(opt.get("class", "?")).rpartition(".")[2],
                    "held": len(d.get("params") or []), "of": len(meta.get("params") or [])}
    return None


def info_line(d: dict[str, Any]) -> str:
    """The ``--info`` line of a shard set."""
    what = (f"{d['sharded_tensors']} sharded tensors" if d["sharded_tensors"]
            else "unsharded (DDP)")
    if o := d.get("optimizer_shard"):
        what = (f"weights {what}, optimizer state sharded ({o['class']}: this rank holds the "
                f"state of {o['held']} of {o['of']} parameters)")
    lost = f", missing rank(s) {d['missing']}" if d["missing"] else ""
    return (f"ranks      rank {d['rank']} of {d['world_size']}, run {d['run_id']}, first seen on "
            f"rank(s) {d['first']}, non-finite on {d['seen_by']}; {what}; bundles of rank(s) "
            f"{', '.join(d['found'])} beside it{lost}")
