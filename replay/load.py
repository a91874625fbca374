"""Reading a recorded step from a bundle: its meta, tensors, batches, RNG states and switches
(the model, loss and optimizer are rebuilt by :mod:`replay.rebuild`).

Safety: a bundle never makes the replay import or call anything by itself. The recorded
factory is used only when its top-level module lives under the current working directory (it
is the user's own code, run where they run it) or when it is passed with ``--factory``; a
recorded loss class or function is imported only from there or from an installed package
(``replay.trust``, ``replay.losses``), never unpickled; optimizers are rebuilt only when they
are ``torch.optim`` built-ins, looked up by attribute.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from recorder.bundle import read_bundle
from recorder.capture import UnrebuildableLeaf, map_tensors, tree_refs, unflatten_tree
from recorder.compat import distributions_validate_default
from recorder.rng import rng_from_bundle

from .errors import ReplayError
from .meta_check import check_meta
from .shard_join import resolve
from .sharded_optim import gather_state
from .switches import switches_as_recorded
from .views import same_view
from .warned_check import warning_as_error


@dataclass
class Step:
    """Everything needed to re-run the recorded step."""

    path: Path
    meta: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    model: nn.Module | None = None
    loss_fn: Any = None
    optimizer: torch.optim.Optimizer | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    problems: list[str] = field(default_factory=list)  # why parts cannot be re-run
    factory_kwargs: dict[str, Any] = field(default_factory=dict)  # what the factory was given
    # the bundle given, when another rank's bundle of its event is replayed (replay.shards)
    given: Path | None = None
    given_rank: int | None = None
    # plain attributes the factory built otherwise than the run had them at attach
    built_otherwise: list[str] = field(default_factory=list)
    # trained tensor attributes set from the bundle (no parameters: another optimizer's)
    trained: list[str] = field(default_factory=list)
    # builds the factory's model again, on a real device (its own initial values), or None
    rebuild: Any = None
    # trained parameters the step's own code writes (the recorder's written_in_step): each
    # re-run starts from them as kept (replay.frozen), their lost entries the factory's
    written: list[str] = field(default_factory=list)
    # why the recorded loss was not rebuilt (replay.losses.Unrebuildable), or None
    loss_unrebuilt: str | None = None
    # the model's generators of another kind than the bundle's state (replay.kept_generators):
    # left as the factory made them
    unrestored: list[str] = field(default_factory=list)
    # the model is its class called with no arguments, the bundle naming no factory: its
    # initial values need not be the run's (a RoPE table of another theta)
    default_args: bool = False
    # buffers whose infinity a division made as the factory built them (replay.pole_buffers)
    pole_buffers: set[str] | None = None
    # the model's or the loss's code edited since the run (replay.edited_code)
    code_edits: list[str] = field(default_factory=list)

    @property
    def event(self) -> dict[str, Any]:
        return self.meta.get("event", {})

    @property
    def stripped(self) -> list[str]:
        return list(self.meta.get("stripped", []))

    @property
    def micro_batches(self) -> list[dict[str, Any]]:
        return self.meta.get("micro_batches", [])


def read_step(path: str | os.PathLike, rank: int | None = None) -> Step:
    meta, tensors = read_bundle(path)
    check_meta(meta, path)
    # one rank's bundle of a distributed event: the first rank's (``rank``: that one of
    # several), full tensors from the shards
    given, given_rank = Path(path), (meta.get("env") or {}).get("rank")
    path, meta, tensors = resolve(given, meta, tensors, check_meta, rank)
    sharded = gather_state(path, meta, tensors)  # (ZeRO's optimizer state, one shard a rank)
    step = Step(path, meta, tensors)
    if sharded:
        step.problems.append(sharded)
    if path != given:
        step.given, step.given_rank = given, given_rank
    return step


# ---------------------------------------------------------------------------------------------
# model


def recorded_device(meta: dict[str, Any]) -> torch.device | None:
    """The device the recorded model ran on (its first module's, not a placeholder's on the
    meta device), None when not recorded."""
    for m in meta.get("modules", []):
        if m.get("device") and m["device"] != "meta":
            return torch.device(m["device"])
    return None


# ---------------------------------------------------------------------------------------------
# batches


def micro_batch_inputs(step: Step, i: int, made: dict[str, torch.Tensor] | None = None
                       ) -> tuple[list, dict]:
    """Copies of micro-batch ``i``'s inputs (a forward that writes into its input,
    wav.div_(peak), must not change the bundle's batch for the re-runs that follow), those
    that required grad in training requiring it again; ``made`` receives them by key."""
    mb = step.micro_batches[i]
    grad = set(mb.get("grad_inputs", ()))
    made = {} if made is None else made

    def copy(node):
        if "$t" not in node or (key := node["$t"]) not in step.tensors:
            return None  # (a missing key: unflatten_tree says so)
        t = step.tensors[key].to(step.device, copy=True)
        made[key] = t.requires_grad_() if key in grad and t.is_floating_point() else t
        return made[key]

    try:
        args, kwargs = unflatten_tree(mb["inputs"], step.tensors, leaf=copy)
    except (UnrebuildableLeaf, KeyError) as e:
        raise ReplayError(f"micro-batch {i} holds an input that cannot be rebuilt ({e}); only "
                          "tensors and JSON values are replayable") from None
    # (sparse and nested inputs are rebuilt from their parts, copied here)
    return _to(args, step.device, copy=True, keep=made), _to(kwargs, step.device, copy=True,
                                                           keep=made)


def loss_inputs(step: Step, i: int, outputs: list[list[torch.Tensor]],
                inputs: dict[str, torch.Tensor] | None = None, objects: list | None = None,
                made: list | None = None, attached: set[int] = frozenset()
                ) -> tuple[list, dict] | None:
    """The loss's recorded arguments for micro-batch ``i``, with the model outputs swapped for
    the re-computed ones (``outputs[k]``: micro-batch ``k``'s, up to ``i``) and its inputs for
    those the re-run fed the model (``inputs``, by key: see ``micro_batch_inputs``). An earlier micro-
    batch's output (one loss over two forwards) is given detached: the gradient the loss sent
    it reaches it from its own recorded output gradient, when its backward runs. An output
    the bundle holds as a whole (a distribution) is taken from ``objects``, as returned.
    ``made`` gets an ``(output, argument)`` pair for each argument made of an output (a cast,
    a view): a new tensor, which the op finder's lineage must know as the output's.
    ``attached``: earlier micro-batches whose outputs are given with their graph (their
    recorded gradient is not fed: replay.unfed_outputs)."""
    tree = step.micro_batches[i].get("loss_inputs")
    if tree is None:
        return None

    def output(node):
        if "$in" in node:  # the micro-batch's own input, as the re-run fed it to the model
            return inputs[node["$in"]] if inputs and node["$in"] in inputs \
                else step.tensors[node["$in"]].to(step.device)
        if isinstance(node.get("$module"), str) and step.model is not None:
            return step.model.get_submodule(node["$module"])  # (the model given to the loss)
        if isinstance(node.get("$param"), str) and step.model is not None:
            return step.model.get_parameter(node["$param"])  # (a parameter given to the loss)
        if node.get("$output") is True and objects is not None:
            return _item(objects[node.get("mb", i)], node.get("path", []))
        if "$out" not in node:
            return None
        k = node.get("mb", i)
        o = outputs[k][node["$out"]]
        if k != i and k not in attached and o.requires_grad:  # (one detached already stays
            o = o.detach()  # that tensor: the op finder's lineage knows it as the model's
            # output, not as data)
        dt = getattr(torch, str(node.get("dtype")), None)
        if isinstance(dt, torch.dtype) and dt.is_floating_point and o.is_floating_point():
            arg = o.to(dt)  # the loss was given a cast of the output (out.float())
        else:
            arg = same_view(o, *node["view"], of=node.get("of")) if "view" in node else o
        if made is not None and arg is not o:
            made.append((o, arg))
        return arg

    # (the outputs are on the device already: moving them is a no-op)
    args, kwargs = _to(unflatten_tree(tree, step.tensors, leaf=output), step.device)
    return args, kwargs


def _item(out: Any, path: list) -> Any:
    """The item of a re-run's output at ``path`` (a loss given ``*model(x)``: each
    distribution of a ``(px, qz)`` output)."""
    for key in path if isinstance(path, list) else [None]:
        try:
            if not isinstance(out, (list, tuple, dict)):
                raise TypeError(type(out).__name__)
            out = out[key]
        except (TypeError, KeyError, IndexError) as e:
            raise ReplayError(f"the loss was given an item of the model output at {path} "
                              f"that the re-run's output has not ({type(e).__name__}: {e})"
                              ) from None
    return out


def differentiates_model(step: Step, mb: int) -> bool:
    """Whether micro-batch ``mb``'s loss was given one of its model inputs that required grad
    (the collocation points of a PINN): it then differentiates the output with respect to it."""
    entry = step.micro_batches[mb]
    grad = set(entry.get("grad_inputs", ()))
    return bool(grad) and any(k in grad for k in tree_refs(entry.get("loss_inputs"), "$in"))


def output_grads(step: Step, i: int) -> dict[int, torch.Tensor]:
    keys = step.micro_batches[i].get("output_grads", {})
    return {int(j): step.tensors[k].to(step.device) for j, k in keys.items() if k in step.tensors}


def _to(obj, device, copy: bool = False, keep: dict[str, torch.Tensor] | None = None):
    """``obj`` (a tree rebuilt from the bundle: lists, tuples, namedtuples, dicts) with its
    tensors on ``device`` (a ``PackedSequence``'s ``batch_sizes`` stay on the CPU); the
    tensors among ``keep``'s values, copies made already, are kept as they are."""
    kept = {id(t) for t in (keep or {}).values()}
    return map_tensors(obj, lambda v: v if id(v) in kept else v.to(device, copy=copy))


def rng_state(step: Step) -> dict[str, Any] | None:
    if "rng" not in step.meta:
        return None
    return rng_from_bundle(step.meta["rng"], step.tensors)


def micro_batch_rng(step: Step, i: int) -> dict[str, Any] | None:
    """The RNG states micro-batch ``i`` began with, when the bundle holds them (a later one,
    recorded since the loop may draw between forwards: an RL loop sampling each action)."""
    rec = step.micro_batches[i].get("rng")
    if not isinstance(rec, dict) or not isinstance(rec.get("keys"), dict):
        return None
    try:
        return rng_from_bundle(rec["meta"], {"rng/" + n: step.tensors[k]
                                             for n, k in rec["keys"].items()})
    except (KeyError, TypeError, ValueError):  # (damaged: the step's states stand)
        return None


def autocast_dtype(mb: dict[str, Any], loss: bool = False) -> torch.dtype | None:
    """The autocast type the micro-batch's forward ran under (``loss``: its loss call, which
    the loop may have made outside the forward's autocast; bundles without it recorded only
    the forward's), None when it ran without autocast."""
    rec = mb.get("loss_autocast" if loss and "loss_autocast" in mb else "autocast") or {}
    return getattr(torch, next(iter(rec.values()))) if rec else None


@contextlib.contextmanager
def autocast_as_recorded(mb: dict[str, Any], device: torch.device, loss: bool = False):
    """Re-enter the autocast region the micro-batch's forward (``loss``: its loss call) ran
    under, on the replay device."""
    dtype = autocast_dtype(mb, loss)
    if dtype is None:
        yield
        return
    with torch.autocast(device_type=device.type, dtype=dtype):
        yield


@contextlib.contextmanager
def run_switches(step: Step):
    """The run's switches, as recorded, put back after: ``validate_args`` (below), the numeric
    switches (``replay.switches``: intra-op threads, default dtype, flush-denormal,
    deterministic mode, matmul precision) and a warning the run raised as an error
    (``replay.warned_check``)."""
    with validate_args_as_recorded(step.meta), switches_as_recorded(step.meta), \
            warning_as_error(step.event):
        yield


@contextlib.contextmanager
def validate_args_as_recorded(meta: dict[str, Any]):
    """torch.distributions' default ``validate_args`` as the training process had it (a
    loop that turned it off went on past values its checks refuse, to the NaN), put back
    after."""
    was = distributions_validate_default()
    recorded = (meta.get("env") or {}).get("distributions_validate_args")
    if isinstance(recorded, bool):
        torch.distributions.Distribution.set_default_validate_args(recorded)
    try:
        yield
    finally:
        torch.distributions.Distribution.set_default_validate_args(was)
