"""Constructor checks of :class:`~recorder.FlightRecorder`: every mistake is reported when the
recorder is built, in one line saying what, why and what to do, never at the first event."""

from __future__ import annotations

import importlib
import inspect
import json
import math
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
    _check_not_replicated(model)
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
    validate_settings(**{k: v for k, v in options.items() if k in _SETTINGS})


# the lowest value each integer setting takes
_COUNTS = {"start_step": 0, "max_skipped_steps": 0, "max_micro_batches": 1}
_SETTINGS = {*_COUNTS, "stats", "min_scale", "lr_scheduler", "factory_kwargs",
             "strict_inf"}


def validate_settings(**settings) -> None:
    """The settings with a range or a set of values (any subset of ``_SETTINGS``)."""
    for name, low in _COUNTS.items():
        v = settings.get(name, low)
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"FlightRecorder: {name} must be an int >= {low}, got {v!r}")
    stats = settings.get("stats", "minmax")
    if stats not in ("minmax", "full"):
        raise ValueError(f"FlightRecorder: stats must be 'minmax' or 'full', got {stats!r}")
    v = settings.get("min_scale", 1.0)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ValueError(f"FlightRecorder: min_scale must be a finite number >= 0 (0 turns the "
                         f"scale-collapse check off), got {v!r}")
    strict = settings.get("strict_inf", False)
    if not isinstance(strict, bool):
        raise TypeError(f"FlightRecorder: strict_inf must be True (every +-Inf is an event) or "
                        f"False (the default: only a +-Inf that reaches the output, the loss, a "
                        f"gradient or a weight, or turns into NaN), got {strict!r}")
    sched = settings.get("lr_scheduler")
    if sched is not None and not callable(getattr(sched, "state_dict", None)):
        raise TypeError(f"FlightRecorder: lr_scheduler must be a scheduler with a state_dict() "
                        f"(torch.optim.lr_scheduler), got {type(sched).__name__}")
    check_factory_kwargs(settings.get("factory_kwargs"), "FlightRecorder: factory_kwargs")


def check_factory_kwargs(kwargs, what: str) -> None:
    """``kwargs`` is None or a dict of identifier keys and JSON values (the bundle stores it and
    the replay passes it to the factory); ``what`` starts the one-line error."""
    if kwargs is None:
        return
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) and k.isidentifier()
                                               for k in kwargs):
        raise TypeError(f"{what} must be a dict of keyword arguments for the factory (names as "
                        f"keys), got {type(kwargs).__name__}: {str(kwargs)[:80]}")
    try:
        json.dumps(kwargs, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what} must hold JSON values only (numbers, strings, booleans, None, "
                        f"lists, dicts), so the bundle can store them ({e})") from None


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


def _check_not_replicated(model: nn.Module) -> None:
    """``nn.DataParallel`` over several devices copies the model onto each device at every
    forward and runs the copies in threads; the copies share the hook dictionaries, so the
    recorder would see each device's calls as the model's, with statistics on other devices.
    (Over one device, or none, it just calls the module: fine.)"""
    for m in model.modules():
        if isinstance(m, nn.DataParallel) and len(m.device_ids) > 1:
            raise ValueError(f"FlightRecorder: nn.DataParallel over {len(m.device_ids)} devices "
                             "is not supported (it runs a copy of the model per device, in "
                             "threads, every step); use DistributedDataParallel under torchrun "
                             "(one process per device), or record on one device")


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
