"""``nanreplay --info``: what a bundle holds, from its header and metadata alone (nothing is
imported from the recorded run or re-run); and the JSON form of it and of the report. Apart
from the report's modules, so that ``--info`` does not import the replay's machinery."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from recorder.bundle_header import HeaderReader, jsonable

from .event_when import event_when
from .meta_check import check_meta
from .shards import describe as describe_shard_set
from .shards import info_line

_GROUPS = {"weights/": "weights", "trained/": "weights", "buffers/": "buffers",
           "grads/": "gradients", "optim/": "optimizer state", "optim_group/": "optimizer state",
           "optim_seq/": "optimizer state",
           "batch/": "batch", "loss_in/": "loss targets", "outgrad/": "output gradients",
           "rng/": "RNG states", "ring/": "ring buffer", "loss/": "loss buffers",
           "sched/": "scheduler", "scaler/": "grad scaler"}


def to_json(report: dict[str, Any]) -> str:
    """The ``--json`` document: the stable keys and more; non-finite numbers as strings."""
    out = {k: v for k, v in report.items() if k != "history"}
    return json.dumps(jsonable(out), indent=2, allow_nan=False)


def info(path) -> dict[str, Any]:
    """What a bundle holds, from its header alone: nothing is imported or re-run."""
    with HeaderReader(path) as r:
        meta, entries = r.meta, r.entries
    check_meta(meta, path)
    sizes: dict[str, dict[str, int]] = {}
    for name, _dtype, _shape, n in entries:
        group = next((g for p, g in _GROUPS.items() if name.startswith(p)), "other")
        s = sizes.setdefault(group, {"tensors": 0, "bytes": 0})
        s["tensors"] += 1
        s["bytes"] += n
    env = meta.get("env", {})
    return {
        "path": str(path),
        "format": meta.get("format"),
        "event": meta.get("event"),
        "state": meta.get("state"),
        "factory": meta.get("factory"),
        "factory_kwargs": meta.get("factory_kwargs"),
        "model": meta.get("model", {}).get("class"),
        "modules": len(meta.get("modules", [])),
        "parameters": len(meta.get("params", [])),
        "optimizer": (meta.get("optimizer") or {}).get("class"),
        "loss": (meta.get("loss") or {}).get("class") or (meta.get("loss") or {}).get("name"),
        "micro_batches": len(meta.get("micro_batches", [])),
        "history_steps": meta.get("ring", {}).get("stored"),
        "stripped": meta.get("stripped", []),
        "shard_set": describe_shard_set(Path(path), meta),
        "sizes": sizes,
        "env": env,
    }


def info_text(d: dict[str, Any]) -> str:
    ev = d.get("event") or {}
    env = d.get("env", {})
    mod = ev.get("module")
    devices = env.get("cuda_devices") or []
    cuda = f"cuda {env.get('cuda')}" + (f" ({', '.join(map(str, devices))})" if devices else "")
    lines = [
        f"bundle     {d['path']} ({d['format']})",
        f"event      {event_when(ev)}, phase {ev.get('phase')}, "
        f"{ev.get('kind') or ev.get('reason')}"  # (a linalg event has no kind)
        + (f", module {'<root>' if mod == '' else mod}" if mod is not None else "")
        + (" (torch.compile'd: recorded as one call)" if ev.get("compiled") else ""),
        f"detail     {ev.get('detail')}",
        f"model      {d['model']} ({d['modules']} modules, {d['parameters']} parameters), "
        f"factory {d['factory']}"
        + (f" {json.dumps(d['factory_kwargs'])}" if d.get("factory_kwargs") else ""),
        f"training   optimizer {d['optimizer']}, loss {d['loss']}, "
        f"{d['micro_batches']} micro-batch(es), {d['history_steps']} steps of history",
        f"env        python {env.get('python')}, torch {env.get('torch')}, {cuda}, "
        f"rank {env.get('rank')}/{env.get('world_size')}",
        f"run        {' '.join(env.get('argv', []))} (commit {env.get('git_commit')})",
    ]
    if d["stripped"]:
        lines.append(f"stripped   {', '.join(d['stripped'])}")
    if d.get("shard_set"):
        lines.append(info_line(d["shard_set"]))
    lines.append("holds")
    for group, s in sorted(d["sizes"].items()):
        lines.append(f"  {group:<18} {s['tensors']:>5} tensors {s['bytes'] / 1e6:>10.2f} MB")
    return "\n".join(lines)
