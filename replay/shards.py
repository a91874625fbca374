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

from pathlib import Path
from typing import Any

from recorder.bundle_header import HeaderReader
from recorder.errors import BundleError


def ranks_of(meta: dict[str, Any]) -> dict[str, Any] | None:
    """The event's rank agreement (run id, rank, world size, first, seen_by), if any."""
    ranks = (meta.get("event") or {}).get("ranks")
    return ranks if isinstance(ranks, dict) and isinstance(ranks.get("run_id"), str) else None


def shard_set(path: Path, meta: dict[str, Any] | None = None) -> dict[int, Path]:
    """Rank -> bundle of the same run id and step as ``path``, from the ``.nan`` files beside
    it (headers only). ``{}`` for a bundle of no distributed event."""
    if meta is None:
        with HeaderReader(path) as r:
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
            with HeaderReader(other, whole=False) as r:
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
