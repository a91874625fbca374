"""Gathering a step into bundle contents: tensors by key and one JSON metadata tree.

Tensor keys (the format is specified in ``docs/bundle-format.md``):
``weights/<param>``, ``buffers/<buffer>``, ``grads/<param>``, ``optim/<param>/<state key>``,
``optim_group/<group>/<key>``, ``batch/<micro-batch>/<n>``, ``loss_in/<micro-batch>/<n>``,
``outgrad/<micro-batch>/<n>``, ``loss/<buffer>``, ``sched/<n>``, ``scaler/<n>``, ``rng/*``,
``ring/*``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .bundle import FORMAT, VERSION
from .capture import environment, flatten_tree, rng_to_bundle, tensor_leaves
from .compiled import hook_sites
from .lossdesc import describe_loss
from .ring import RingBuffer
from .settings import Settings
from .shards import class_name, localize
from .tape import Tape
from .target import Target


def qualname(obj: Any) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _json_scalar(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


def _jsonish(v: Any) -> bool:
    if _json_scalar(v):
        return True
    if isinstance(v, (list, tuple)):
        return all(_jsonish(x) for x in v)
    return False


@dataclass
class Sources:
    """What a bundle is built from: the recorder's parts (not its private state)."""

    settings: Settings
    target: Target
    ring: RingBuffer
    buffer_copies: dict[str, torch.Tensor]  # pre-step values (recorder.buffers)
    loss_fn: nn.Module | None
    loss_recorded: bool  # a loss was given to record_loss (nothing to re-run it with)
    recorder: dict[str, Any]  # the bundle's "recorder" entry
    commit: str | None  # the git commit of the working directory


def build_bundle(src: Sources, tape: Tape | None, event: dict[str, Any], *,
                 guard: dict[str, Any] | None, rank: int, world_size: int
                 ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    settings, target = src.settings, src.target
    model, opt = target.model(), target.optimizer()
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, Any] = {
        "format": f"{FORMAT}/{VERSION}",
        "event": event,
        "factory": settings.factory,
        "factory_kwargs": settings.factory_kwargs,
        "state": "after_update" if event.get("after_update") else "before_update",
        "allow_inf": list(settings.allow_inf),
        "strict_inf": settings.strict_inf,
    }
    _model(src, tape, guard, meta, tensors)
    if model is not None:
        meta["model"] = {"class": class_name(model), "training": model.training}
        meta["modules"] = [_module_info(s.name, s.module) for s in hook_sites(model)]
        meta["compiled_regions"] = sorted(target.compiled)  # recorded as one call each
    if tape is not None:
        meta["call_order"] = [[m, mb] for m, mb, *_ in sorted(
            tape.calls, key=lambda c: (c[1], c[2]))]
        rng_meta, rng_tensors = rng_to_bundle(tape.rng)
        meta["rng"] = rng_meta
        tensors.update(rng_tensors)
        meta["micro_batches"] = [_micro_batch(i, mb, tensors)
                                 for i, mb in enumerate(tape.micro_batches)]
    _training_objects(src, guard, meta, tensors)
    # -- history and environment
    n_groups = len(opt.param_groups) if opt is not None else 0
    ring_meta, ring_tensors = src.ring.export(len(target.params), n_groups)
    meta["ring"] = ring_meta
    tensors.update(ring_tensors)
    meta["recorder"] = src.recorder
    meta["env"] = environment(rank, world_size, src.commit)
    localize(meta, tensors)  # FSDP2: this rank's local shards, and where they sit
    return meta, tensors


def _model(src: Sources, tape: Tape | None, guard, meta, tensors) -> None:
    """Weights, gradients (the guard's copies from before the update, when kept) and buffers
    (their pre-step values)."""
    params = src.target.params
    meta["params"] = [n for n, _ in params]
    for name, p in params:
        w = guard["weights"].get(name, p) if guard else p
        tensors[f"weights/{name}"] = w.detach()
        g = guard["grads"].get(name) if guard else p.grad
        if g is not None:
            tensors[f"grads/{name}"] = g.detach()
    meta["buffers"] = []
    for name, b in src.target.buffers:
        # the copy from the last step start at which the buffer had changed is its pre-step
        # value, also when this step's forward changed it (even if it rarely changes)
        copy = src.buffer_copies.get(name) if tape is not None else None
        tensors[f"buffers/{name}"] = (copy if copy is not None else b).detach()
        meta["buffers"].append(name)


def _training_objects(src: Sources, guard, meta, tensors) -> None:
    """The optimizer, scheduler, GradScaler and loss."""
    target = src.target
    opt = target.optimizer()
    if opt is not None:
        meta["optimizer"] = _optimizer(opt, target.params, guard, tensors)
    sched = target.scheduler()
    if sched is not None:
        tree, ts, _ = flatten_tree(sched.state_dict(), "sched")
        tensors.update(ts)
        meta["lr_scheduler"] = {"class": qualname(sched), "state": tree}
    scaler = target.scaler()
    if scaler is not None:
        tree, ts, _ = flatten_tree(scaler.state_dict(), "scaler")
        tensors.update(ts)
        meta["grad_scaler"] = {"class": qualname(scaler), "state": tree}
    if src.loss_fn is not None:
        meta["loss"] = describe_loss(src.loss_fn, tensors)
    elif src.loss_recorded:  # given to record_loss: checked, but nothing to re-run it with
        meta["loss"] = {"kind": "recorded"}


def _module_info(name: str, m: nn.Module) -> dict[str, Any]:
    t = next(iter(m.parameters(recurse=False)), None)
    if t is None:
        t = next(iter(m.buffers(recurse=False)), None)
    return {"name": name, "type": class_name(m), "training": m.training,
            "dtype": str(t.dtype).removeprefix("torch.") if t is not None else None,
            "device": str(t.device) if t is not None else None}


def _micro_batch(i: int, mb, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    tree, ts, paths = flatten_tree([list(mb.args), mb.kwargs], f"batch/{i}")
    tensors.update(ts)
    out: dict[str, Any] = {"inputs": tree, "paths": paths, "grad_enabled": mb.grad_enabled,
                           "autocast": mb.autocast}
    outs = list(tensor_leaves(mb.outputs))
    if mb.loss_args is not None:
        ltree, lts, lpaths = flatten_tree([list(mb.loss_args), mb.loss_kwargs or {}],
                                          f"loss_in/{i}", leaf=partial_leaf(outs))
        tensors.update(lts)
        out["loss_inputs"], out["loss_paths"] = ltree, lpaths
    grads = {}
    for j, g in mb.out_grads.items():
        key = f"outgrad/{i}/{j}"
        tensors[key] = g.detach()
        grads[str(j)] = key
    out["output_grads"] = grads
    out["n_outputs"] = len(outs)
    return out


def partial_leaf(outs: list[torch.Tensor]):
    """Stand-in for loss inputs that are the model output or a view of it, so the replay feeds
    the loss its own re-computed output instead of a recorded copy."""

    def leaf(t: torch.Tensor):
        for i, o in enumerate(outs):
            if t is o:
                return {"$out": i}
        for i, o in enumerate(outs):
            if (t.device == o.device and t.dtype == o.dtype
                    and t.untyped_storage().data_ptr() == o.untyped_storage().data_ptr()):
                return {"$out": i, "view": [list(t.shape), list(t.stride()),
                                            t.storage_offset() - o.storage_offset()]}
        return None

    return leaf


def _optimizer(opt, params, guard, tensors) -> dict[str, Any]:
    names = {id(p): n for n, p in params}
    groups = []
    hyper = guard["hyper"] if guard else [{k: v for k, v in g.items() if k != "params"}
                                          for g in opt.param_groups]
    for gi, (g, h) in enumerate(zip(opt.param_groups, hyper)):
        entry: dict[str, Any] = {"params": [names.get(id(p)) for p in g["params"]]}
        for k, v in h.items():
            if isinstance(v, torch.Tensor):
                key = f"optim_group/{gi}/{k}"
                tensors[key] = v.detach()
                entry[k] = {"$t": key}
            elif _jsonish(v):
                entry[k] = list(v) if isinstance(v, tuple) else v
            else:
                entry[k] = {"$repr": repr(v)[:200]}
        groups.append(entry)
    scalars: dict[str, dict[str, Any]] = {}
    for p in (p for g in opt.param_groups for p in g["params"]):
        name = names.get(id(p))
        if name is None:
            continue
        state = guard["state"].get(name, {}) if guard else opt.state.get(p, {})
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                tensors[f"optim/{name}/{k}"] = v.detach()
            elif _jsonish(v):
                scalars.setdefault(name, {})[k] = v
    defaults = {k: (list(v) if isinstance(v, tuple) else v) for k, v in opt.defaults.items()
                if _jsonish(v)}
    return {"class": qualname(opt), "defaults": defaults, "param_groups": groups,
            "state_scalars": scalars}
