"""Gathering a step into bundle contents: tensors by key and one JSON metadata tree.

Tensor keys (the format is specified in ``docs/bundle-format.md``):
``weights/<param>``, ``buffers/<buffer>``, ``grads/<param>``, ``optim/<param>/<state key>``,
``optim_group/<group>/<key>``, ``batch/<micro-batch>/<n>``, ``loss_in/<micro-batch>/<n>``,
``outgrad/<micro-batch>/<n>``, ``loss/<buffer>``, ``sched/<n>``, ``scaler/<n>``, ``rng/*``,
``ring/*``, and with ``rewind`` on, ``rewind/*`` (:mod:`recorder.rewind`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .abandoned import marked
from .added_params import added_after_attach
from .attributes import AttributeWatch, trained_tensors
from .bundle import FORMAT, VERSION
from .capture import environment, flatten_tree
from .code_identity import code_identity
from .comm_hooks import comm_hooks_meta
from .compat import in_functional_call
from .compiled import forward_compiled_alone, hook_sites
from .config_args import describe_init
from .constants import unchanged
from .entries import hyper_entry, jsonish, micro_batch_entry, named_params
from .graph_reach import from_model
from .inner_optim import describe_inner, full_state
from .late_writes import moved_in_step
from .lossdesc import describe_callable, describe_loss
from .patched_forward import patched_forward
from .rewind import Rewind
from .ring import RingBuffer
from .rng import rng_to_bundle
from .samples import of_micro_batch
from .seq_state import store_seq
from .settings import Settings
from .shards import class_name, localize, mixed_precision
from .stock_model import describe_stock
from .tape import Tape
from .target import Target
from .target_inputs import forward_names
from .tied import tied_params
from .user_hooks import module_hooks_meta, user_grad_hooks
from .wrapped import store_wrapped


def qualname(obj: Any) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


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
    rewind: Rewind | None  # the rewind window's copy and steps (recorder.rewind), if on


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
        "allow_nan": list(settings.allow_nan),
        "strict_inf": settings.strict_inf,
    }
    _model(src, tape, guard, meta, tensors)
    if model is not None:
        meta["model"] = {"class": class_name(model), "training": model.training}
        if settings.factory is None:  # the replay's guess at one (see default_factory)
            meta["model"].update(_without_factory(model))
        meta["modules"] = [_module_info(s.name, s.module, target.attributes, tensors)
                           for s in hook_sites(model)]
        meta.update(module_hooks_meta([(s.name, s.module) for s in hook_sites(model)]))
        meta["compiled_regions"] = sorted(target.compiled)  # recorded as one call each
        meta["passthrough_modules"] = sorted(target.passing)  # recorded as no call
    if tape is not None:
        meta["call_order"] = [[m, mb] for m, mb, *_ in sorted(
            tape.calls, key=lambda c: (c[1], c[2]))]
        rng_meta, rng_tensors = rng_to_bundle(tape.rng)
        meta["rng"] = rng_meta
        tensors.update(rng_tensors)
        mbs = tape.micro_batches
        meta["micro_batches"] = marked(tape, [micro_batch_entry("", i, mb, tensors, mbs[:i],
                                                                target.module_ids,
                                                                named_params(target.params))
                                              for i, mb in enumerate(mbs)])
        for entry, mb in zip(meta["micro_batches"], tape.micro_batches):
            s = of_micro_batch(mb, target.seq_first, target.recurrent, forward_names(model))
            entry["samples"] = {"size": s.size, "seq_first": s.seq_first,
                                "recurrent": s.recurrent}
            # (only those made from the model's weights: not a peer network's output)
            if grad_args := [k for k in entry.pop("loss_grad_args", ()) if from_model(
                    tensors[k], (), [p for _, p in target.params])]:
                entry["loss_grad_args"] = grad_args
    _training_objects(src, guard, meta, tensors)
    if tape is not None:  # the loss's buffers as the step found them (DINO's centre)
        tensors.update({k: copy.detach() for k, copy in src.buffer_copies.items()
                        if k.startswith("loss/") and k in tensors})
    # -- history and environment
    n_groups = len(opt.param_groups) if opt is not None else 0
    ring_meta, ring_tensors = src.ring.export(len(target.params), n_groups)
    meta["ring"] = ring_meta
    tensors.update(ring_tensors)
    meta["recorder"] = src.recorder
    if src.rewind is not None:  # the copy and the window of steps since
        meta["rewind"] = src.rewind.export(tensors)
    meta["env"] = environment(rank, world_size, src.commit)
    localize(meta, tensors, model)  # FSDP2, TP: this rank's local shards, and where they sit
    return meta, store_wrapped(meta, tensors)  # (after localize: DTensors are shards by then)


def _model(src: Sources, tape: Tape | None, guard, meta, tensors) -> None:
    """Weights, gradients (the guard's copies from before the update, when kept) and buffers
    (their pre-step values)."""
    params = src.target.params
    meta["params"] = [n for n, _ in params]
    if (model := src.target.model()) is not None and (tied := tied_params(model)):
        meta["tied_params"] = tied  # (bundled once, under the first name)
    if (tape is None or not tape.micro_batches) and model is not None \
            and forward_compiled_alone(model):  # (no forward recorded: recorder.compiled)
        meta["forward_compiled_alone"] = True
    if tape is not None and tape.transformed:  # (its forwards ran under torch.func only)
        meta["forward_transformed_alone"] = True
    if frozen := [n for n, p in params if not p.requires_grad]:  # (as the step ran: a teacher
        meta["frozen"] = frozen  # the loop froze after the factory built it trainable)
    if constants := [params[i][0] for i in src.target.constants
                     if unchanged(src.target.constants, i, params[i][1])]:
        meta["inf_constants"] = constants  # (frozen ±inf mask values: recorder.constants)
    if src.target.unowned:  # (trained, not the recorded optimizer's: another one updates them)
        meta["unheld_trained"] = [params[i][0] for i, _ in src.target.unowned]
    changed = src.target.changed_in_step(tape) if tape is not None else []
    if changed:  # (not by the recorded optimizer, whose step has not run): their new values
        meta["changed_in_step"] = [params[i][0] for i in changed]
        if tape.updated_elsewhere:  # by an optimizer the recorder was not given
            meta["stepped_elsewhere"] = True
    if tape is not None and not tape.evaluation and moved_in_step(tape, src.target.watched):
        # (the loop moved the recorded optimizer's weights in place while the step was open,
        # outside its step(): schedule-free's optimizer.train() after the forward)
        meta["weights_moved_in_step"] = True
    written = src.target.written_in_step(tape) if tape is not None else []
    if written:  # before the first update: the step's own code wrote them (a data-dependent init)
        meta["written_in_step"] = [params[i][0] for i in written]
    if model is not None and (added := added_after_attach(model, params)):
        meta["after_attach"] = added  # (a block grown, weight_norm applied: not recorded)
    if src.target.replaced:  # swapped for new tensors (densified): shapes the factory lacks
        # (or, at an event inside functional_call, the call's own tensors: not the loop's)
        meta["functional_call_params" if in_functional_call() else "replaced_params"] = \
            sorted(src.target.replaced)
    if hooked := user_grad_hooks(params):  # (the script's own: the factory's model lacks them)
        meta["user_grad_hooks"] = hooked
    for name, p in params:
        w = guard["weights"].get(name, p) if guard else p
        tensors[f"weights/{name}"] = w.detach()
        g = guard["grads"].get(name) if guard else p.grad
        if g is not None:
            # a sparse gradient (nn.Embedding(sparse=True)) is stored dense: the weight beside
            # it is as large, and its zeros compress to next to nothing
            tensors[f"grads/{name}"] = (g if g.layout == torch.strided else g.to_dense()).detach()
    if any(p.grad is not None and p.grad.grad_fn is not None for _, p in params):
        meta["grads_graph"] = True  # (backward(create_graph=True): SophiaH's update needs it)
    meta["buffers"] = []
    for name, b in src.target.buffers:
        # the copy from the last step start at which the buffer had changed is its pre-step
        # value, also when this step's forward changed it (even if it rarely changes)
        copy = src.buffer_copies.get(name) if tape is not None else None
        tensors[f"buffers/{name}"] = (copy if copy is not None else b).detach()
        meta["buffers"].append(name)


def _training_objects(src: Sources, guard, meta, tensors) -> None:
    """The optimizer, scheduler, GradScaler and loss; DDP's communication hooks, which made
    the gradients the optimizer was given; the fingerprints of the model's and loss's code."""
    target = src.target
    if (ddp := comm_hooks_meta(target.ddp)) is not None:
        meta["ddp"] = ddp
    opt = target.optimizer()
    if opt is not None:
        meta["optimizer"] = _optimizer(opt, target.params, guard, tensors)
    sched = target.scheduler()
    if sched is not None:
        tree, ts, _ = flatten_tree(sched.state_dict(), "sched")
        tensors.update(ts)
        meta["lr_scheduler"] = {"class": qualname(_inner_scheduler(sched)), "state": tree}
    scaler = target.scaler()
    if scaler is not None:
        tree, ts, _ = flatten_tree(scaler.state_dict(), "scaler")
        tensors.update(ts)
        meta["grad_scaler"] = {"class": qualname(scaler), "state": tree}
    if src.loss_fn is not None:
        meta["loss"] = describe_loss(src.loss_fn, tensors, target.module_ids())
        if started := target.attributes.loss_started():  # (it is described as the event left it)
            meta["loss"]["started"] = started
            meta["loss"]["attrs_at_attach"] = target.attributes.loss_at_attach()  # (the window's)
    elif src.loss_recorded:  # given to record_loss: checked, but nothing to re-run it with
        meta["loss"] = {"kind": "recorded"}
    if code := code_identity(target.model(), src.loss_fn):  # (the code the replay is checked
        meta["code"] = code  # against: an edit since the run, replay.edited_code)


def _inner_scheduler(sched):
    """The scheduler inside accelerate's ``AcceleratedScheduler`` (``prepare(scheduler)``),
    whose state_dict is the inner one's; any other as it is."""
    inner = getattr(sched, "scheduler", None)
    return inner if type(sched).__name__ == "AcceleratedScheduler" and inner is not None \
        else sched


def _module_info(name: str, m: nn.Module, attributes: AttributeWatch, tensors
                 ) -> dict[str, Any]:
    t = next(iter(m.parameters(recurse=False)), None)
    if t is None:
        t = next(iter(m.buffers(recurse=False)), None)
    info = {"name": name, "type": class_name(m), "training": m.training,
            "dtype": str(t.dtype).removeprefix("torch.") if t is not None else None,
            "device": str(t.device) if t is not None else None}
    fsdp = mixed_precision(m)  # FSDP2: what its MixedPrecisionPolicy computed in
    if fsdp is not None:
        info["fsdp"] = fsdp
    if attrs := attributes.changed(name, m):  # what the loop set (see .attributes)
        info["attrs"] = attrs
    if attached := attributes.at_attach.get(name):  # (set before attach: an init pass's flag)
        info["attrs_at_attach"] = attached
    if patch := patched_forward(m):  # (a trainer's patch: TRL's fused LM head)
        info["forward"] = patch
    if trained := trained_tensors(m):  # as the event found them (another optimizer's)
        info["trained"] = sorted(trained)
        for k, v in trained.items():
            tensors[f"trained/{name}.{k}" if name else f"trained/{k}"] = v.detach()
    return info


def _optimizer(opt, params, guard, tensors) -> dict[str, Any]:
    names = {id(p): n for n, p in params}
    groups = []
    hyper = guard["hyper"] if guard else [{k: v for k, v in g.items() if k != "params"}
                                          for g in opt.param_groups]
    for gi, (g, h) in enumerate(zip(opt.param_groups, hyper)):
        entry: dict[str, Any] = {"params": [names.get(id(p)) for p in g["params"]]}
        groups.append(hyper_entry(h, f"optim_group/{gi}", tensors, entry))
    scalars: dict[str, dict[str, Any]] = {}
    for p in (p for g in opt.param_groups for p in g["params"]):
        name = names.get(id(p))
        if name is None:
            continue
        state = guard["state"].get(name, {}) if guard else full_state(opt, p)
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                tensors[f"optim/{name}/{k}"] = v.detach()
            elif store_seq(name, k, v, tensors, scalars):  # (quantised: codes and scales)
                continue
            elif jsonish(v):
                scalars.setdefault(name, {})[k] = v
    defaults = {k: (list(v) if isinstance(v, tuple) else v) for k, v in opt.defaults.items()
                if jsonish(v)}
    out = {"class": qualname(opt), "defaults": defaults, "param_groups": groups,
           "state_scalars": scalars, "attrs": _optimizer_attrs(opt)}
    if inner := describe_inner(opt, names):  # (a wrapper's: ZeRO's local shard optimizer)
        out["inner"] = inner
    return out


def _optimizer_attrs(opt) -> dict[str, Any]:
    """A custom optimizer's settings kept outside its groups (``self.clip = clip``): the
    public plain scalars of the instance, which a factory that builds it otherwise would
    change (the replay sets them back and says so: ``replay.optim_attrs``)."""
    return {k: v for k, v in getattr(opt, "__dict__", {}).items()
            if not k.startswith("_") and k not in ("defaults", "state", "param_groups")
            and (v is None or type(v) in (bool, int, float, str)) and jsonish(v)}


def _without_factory(model: nn.Module) -> dict[str, Any]:
    """What rebuilds a model recorded without a factory: its class called bare
    (``default_factory``), else, made of torch.nn's own modules only, their description; and
    the constructor arguments it keeps as data (``init``: ``self.config``), which the replay
    calls the class with rather than bare."""
    guess = default_factory(model)
    stock = describe_stock(model) if guess is None else None
    init = describe_init(model)
    return {"default_factory": guess, **({"stock": stock} if stock is not None else {}),
            **({"init": init} if init is not None else {})}


def default_factory(model: nn.Module) -> str | None:
    """``module:Class`` of the model's class when calling it with no arguments could build it
    again (every argument of its ``__init__`` has a default) and an import reaches it (as
    :func:`describe_callable` finds one for a loss: a class of the training script by the name
    the replay imports that script as): the replay's factory when none was given."""
    cls = type(model)
    spec = describe_callable(cls).get("import")
    if spec is None or spec.split(".")[0] == "torch":
        return None  # (torch's own classes take their layers or sizes: nn.Sequential(...))
    try:
        params = list(inspect.signature(cls).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
           for p in params):
        return None
    return spec
