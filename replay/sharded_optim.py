"""An optimizer whose state is sharded across the ranks (ZeRO-1: ``ZeroRedundancyOptimizer``),
put back together for the one-process replay.

``ZeroRedundancyOptimizer`` keeps a local optimizer (its ``optimizer_class``, a ``torch.optim``
built-in such as Adam) over this rank's shard of the parameters only: each rank's bundle holds
the state of its own shard (``optim/<name>/optim::exp_avg``) and ``meta["optimizer"]["inner"]``
says which parameters it holds (``recorder.inner_optim.describe_inner``). The replay reads the
state of the other parameters from the sibling bundles of the same event (no
``consolidate_state_dict`` in the user's loop), rebuilds the local optimizer's class over every
parameter with the wrapper's groups, and says so: which rank held which parameters, and that an
update of a parameter ran on the rank that holds its state, then was broadcast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from recorder.bundle import read_bundle
from recorder.inner_optim import SEP

from .shards import ranks_of, shard_set


def sharded_inner(info: dict[str, Any] | None) -> tuple[str, dict[str, Any]] | None:
    """``(attribute, description)`` of the optimizer's inner optimizer that holds a shard of
    its parameters, or None."""
    for attr, d in ((info or {}).get("inner") or {}).items():
        if isinstance(d, dict) and d.get("sharded"):
            return attr, d
    return None


def builtin_inner(info: dict[str, Any] | None) -> tuple[str, type] | None:
    """``(attribute, class)`` of the one inner optimizer whose class is a ``torch.optim``
    built-in (ZeRO's local Adam), which a wrapper that is none delegates its update to."""
    inner = (info or {}).get("inner") or {}
    found = [(attr, getattr(torch.optim, d["class"].rpartition(".")[2], None))
             for attr, d in inner.items()
             if isinstance(d, dict) and str(d.get("class", "")).startswith("torch.optim.")]
    found = [(a, c) for a, c in found if isinstance(c, type)]
    return found[0] if len(found) == 1 else None


def unprefixed(state: dict[str, Any], attr: str) -> dict[str, Any]:
    """``state`` with the inner optimizer ``attr``'s keys as its own (``optim::exp_avg`` ->
    ``exp_avg``): the state of the inner optimizer rebuilt in the wrapper's place."""
    pre = f"{attr}{SEP}"
    return {k.removeprefix(pre): v for k, v in state.items() if k.startswith(pre)}


def as_rebuilt(info: dict[str, Any] | None, opt, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` as recorded (the wrapper's keys) for ``opt``: unprefixed when ``opt`` is the
    wrapper's inner built-in class rebuilt in its place (:func:`builtin_inner`), which would
    drop the prefixed keys; else as it is."""
    found = builtin_inner(info)
    if found is None or type(opt) is not found[1] or str((info or {}).get("class", "")) \
            .startswith("torch.optim."):
        return state
    return unprefixed(state, found[0])


def gather_state(path: Path, meta: dict[str, Any], tensors: dict[str, torch.Tensor]
                 ) -> str | None:
    """Add to ``tensors`` (and ``meta``'s state scalars) the optimizer state the other ranks'
    bundles hold for the parameters whose state this rank did not hold; the note that says so,
    or None when the state is not sharded."""
    info = meta.get("optimizer") or {}
    if (found := sharded_inner(info)) is None or ranks_of(meta) is None:
        return None
    attr, mine = found
    rank = int(ranks_of(meta)["rank"])
    holders = {rank: list(mine.get("params") or [])}
    scalars = info.setdefault("state_scalars", {})
    for r, other in sorted(shard_set(path, meta).items()):
        if r == rank:
            continue
        m, t = read_bundle(other)
        theirs = sharded_inner(m.get("optimizer")) or (attr, {})
        holders[r] = list(theirs[1].get("params") or [])
        for name in holders[r]:  # (the step's state, and a rewind copy's: ``rewind/optim/``)
            prefixes = (f"optim/{name}/", f"rewind/optim/{name}/")
            tensors.update({k: v for k, v in t.items()
                            if k.startswith(prefixes) and k not in tensors})
            for k, v in ((m.get("optimizer") or {}).get("state_scalars") or {}).get(
                    name, {}).items():
                scalars.setdefault(name, {}).setdefault(k, v)
            mine_rw = ((meta.get("rewind") or {}).get("optimizer") or {})
            for k, v in ((((m.get("rewind") or {}).get("optimizer") or {})
                          .get("state_scalars") or {}).get(name, {}).items()):
                mine_rw.setdefault("state_scalars", {}).setdefault(name, {}).setdefault(k, v)
    return _note(info, attr, holders, meta, int(ranks_of(meta)["world_size"]))


def _note(info, attr, holders: dict[int, list[str]], meta, world: int) -> str:
    cls = str(info.get("class", "?")).rpartition(".")[2]
    inner = str(info["inner"][attr].get("class", "?")).rpartition(".")[2]
    held = "; ".join(f"rank {r}: {', '.join(ns) or 'none'}" for r, ns in sorted(holders.items()))
    lost = [r for r in range(world) if r not in holders]
    text = (f"the optimizer's state is sharded across {world} ranks ({cls}: each rank's "
            f"{inner} holds the state of its own parameters; {held}); ")
    if lost:
        text += (f"no bundle of rank(s) {lost} is beside this one, so their parameters' state "
                 "is missing from the re-run's update: copy every rank's bundle of the step here")
    else:
        text += ("the replay reads every rank's shard from their bundles (no "
                 "consolidate_state_dict needed)")
    owner = {n: r for r, ns in holders.items() for n in ns}
    ev = meta.get("event") or {}
    if ev.get("phase") == "optimizer" and (made := [n for n in ev.get("params") or []
                                                    if n in owner]):
        by = "; ".join(f"{n} on rank {owner[n]}" for n in made)
        text += (f"; each parameter's update ran on the rank holding its state, then was "
                 f"broadcast to every rank ({by})")
    return text
