"""Constructor checks of :class:`~recorder.FlightRecorder`: every mistake is reported when the
recorder is built, in one line saying what, why and what to do, never at the first event."""

from __future__ import annotations

import importlib
import inspect
import tempfile
from pathlib import Path

import torch
from torch import nn

ON_EVENT = ("raise", "warn")


def validate(model, optimizer, loss_fn, out_dir, factory, history, on_event, allow_inf,
              scaler) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"FlightRecorder: model must be a torch.nn.Module, got "
                        f"{type(model).__name__}; pass the module whose forward runs the step")
    _check_unsharded(model)
    if optimizer is not None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"FlightRecorder: optimizer must be a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}; pass None for loops without one")
        own = {id(p) for p in model.parameters()}
        stray = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in own]
        if stray:
            shapes = ", ".join(str(list(p.shape)) for p in stray[:3])
            raise ValueError(f"FlightRecorder: {len(stray)} optimizer parameter(s) are not "
                             f"parameters of the model (shapes {shapes}); build the optimizer "
                             "from this model's parameters()")
    validate_options(loss_fn, out_dir, factory, history, on_event, allow_inf)
    if scaler is not None and not hasattr(scaler, "_per_optimizer_states"):
        raise TypeError(f"FlightRecorder: scaler must be a torch.amp.GradScaler, got "
                        f"{type(scaler).__name__}")


FROM_TRAINER = ("optimizer", "scaler", "lr_scheduler", "start_step")


def validate_callback_options(loss_fn, options: dict) -> None:
    """A training-framework callback's options, checked when it is built: the Trainer supplies
    the optimizer, scheduler, scaler and first step; the rest are FlightRecorder's."""
    taken = [k for k in FROM_TRAINER if k in options]
    if taken:
        raise TypeError(f"FlightRecorderCallback: {', '.join(taken)} come(s) from the Trainer; "
                        "leave them out")
    from .flight import FlightRecorder  # (flight imports this module)

    known = set(inspect.signature(FlightRecorder).parameters) - {"model", "optimizer"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"FlightRecorderCallback: unknown option(s) {', '.join(unknown)}; it "
                        f"takes FlightRecorder's: {', '.join(sorted(known - set(FROM_TRAINER)))}")
    validate_options(loss_fn, options.get("out_dir", "nan-bundles"), options.get("factory"),
                     options.get("history", 64), options.get("on_event", "raise"),
                     options.get("allow_inf", ()))


def validate_options(loss_fn, out_dir, factory, history, on_event, allow_inf) -> None:
    """The checks that need no model (a training-framework callback makes them when built)."""
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"FlightRecorder: loss_fn must be callable, got {type(loss_fn).__name__}")
    if on_event not in ON_EVENT:
        raise ValueError(f"FlightRecorder: on_event must be 'raise' or 'warn', got {on_event!r}")
    if not isinstance(history, int) or history < 1:
        raise ValueError(f"FlightRecorder: history must be a positive int, got {history!r}")
    if isinstance(allow_inf, str) or not all(isinstance(p, str) for p in allow_inf):
        raise TypeError("FlightRecorder: allow_inf must be a list of name patterns such as "
                        "['*.attn.mask']")
    _check_writable(Path(out_dir))
    if factory is not None:
        _check_factory(factory)


def _check_unsharded(model: nn.Module) -> None:
    """Sharded parameters (FSDP's ``fully_shard``, tensor parallel: DTensors; FSDP1's flat
    parameters) are refused now: their statistics would run collectives from hooks, and writing
    a bundle on the rank that saw an event would wait forever for the others' shards."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return
    sharded = any(isinstance(m, FullyShardedDataParallel) for m in model.modules()) or \
        any(isinstance(p, DTensor) for p in model.parameters())
    if sharded:
        raise ValueError("FlightRecorder: the model's parameters are sharded (FSDP or tensor "
                         "parallel), which the recorder does not support: a bundle would need "
                         "every rank's shards. Record the model unsharded (one process, or "
                         "DistributedDataParallel)")


def _check_writable(out_dir: Path) -> None:
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out_dir, prefix=".nanreplay-probe-"):
            pass
    except OSError as e:
        raise ValueError(f"FlightRecorder: out_dir '{out_dir}' is not writable "
                         f"({e.strerror or e}); pass a directory this process can write") from None


def import_object(module: str, attr: str):
    """``module`` imported, then the dotted ``attr`` looked up in it (a factory's two parts).
    Raises whatever the import or the lookup raises: callers add their own context."""
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _check_factory(factory: str) -> None:
    mod, _, fn = factory.partition(":")
    if not mod or not fn:
        raise ValueError(f"FlightRecorder: factory {factory!r} is not of the form "
                         "'module:function' (e.g. 'mypkg.train:make_model')")
    try:
        obj = import_object(mod, fn)
    except Exception as e:
        raise ValueError(f"FlightRecorder: factory {factory!r} cannot be imported "
                         f"({type(e).__name__}: {e}); pass 'module:function' importable from "
                         "this process") from None
    if not callable(obj):
        raise ValueError(f"FlightRecorder: factory {factory!r} is not callable")
