"""Rebuilding what ran from a bundle: the model (from its factory, its class called bare, or
torch.nn's own modules described in the bundle), the bundle's weights in it, the loss and the
optimizer (see :func:`build`)."""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import nn

from recorder.compiled import decompile

from .attributes import built_otherwise, restore_attributes, restore_trained, restored_note
from .config_args import init_factory, missing_note
from .edited_code import code_edits, edits_text
from .errors import FactoryRefused, ReplayError, one_line
from .factory import recorded_argv, resolve_factory
from .factory_params import taken_kwargs
from .fx_lines import remember
from .kept_generators import (
    model_generators,
    other_kinds,
    other_kinds_note,
    restored_loss_attributes,
)
from .load import Step, recorded_device, rng_state
from .loss_held_params import rebind_loss_params
from .loss_params import attach_loss_params
from .losses import Unrebuildable, kept_defaults, rebuild_loss
from .optim import build_optimizer
from .patched_forward import check_patched_forwards
from .run_home import where_advice
from .spawned_class import spawned_advice
from .stock_model import stock_factory
from .weights import load_weights
from .written_weights import refill_written


def build(step: Step, factory, device: str | None,
          factory_kwargs: dict[str, Any] | None = None) -> None:
    """Fill ``step.model``, ``step.loss_fn``, ``step.optimizer`` (or say in ``step.problems``
    why they cannot be rebuilt). ``factory``: ``"module:function"`` or a callable; its
    ``factory_kwargs`` replace the recorded ones."""
    meta = step.meta
    step.device = torch.device(device) if device else recorded_device(meta) or torch.device("cpu")
    no_cuda = step.device.type == "cuda" and not torch.cuda.is_available()
    if no_cuda and device:
        raise ReplayError(f"--device {device}: this machine has no CUDA device; pass "
                          "--device cpu")
    if step.stripped:  # the step cannot be re-run: report what the ring buffer tells
        if no_cuda:  # nothing runs, so a GPU bundle's copy is read here without --device cpu
            step.device = torch.device("cpu")
        parts = sorted(set(step.stripped))
        verb = "was" if parts == ["batch"] else "were"
        step.problems.append(f"the {' and the '.join(parts)} {verb} stripped from this bundle")
        return
    if no_cuda:
        raise ReplayError(f"the bundle was recorded on {step.device} and this machine has no "
                          "CUDA device; pass --device cpu")
    spec = factory or meta.get("factory")
    init = kept_init(meta)
    if not spec or (init and factory == init["class"] and not factory_kwargs):
        # (--factory naming the model's class trusts it, called with the arguments it kept)
        _build_without_factory(step, factory_kwargs, trusted=bool(spec))
        return
    with recorded_argv(meta, spec):
        _build(step, spec, factory is not None, factory_kwargs)


NO_FACTORY = "the bundle names no model factory"
NO_FACTORY_NEEDED = f"{NO_FACTORY}, and none is needed here: the values are in the bundle's batch"


def _how(meta: dict[str, Any]) -> str:
    """What re-runs the step of a model recorded without a factory: ``--factory``, or the
    Python API given the function; a class defined in ``__main__`` (a notebook cell), which no
    import reaches, passed itself by its name there."""
    model = meta.get("model") or {}
    cls = model.get("class") or ""
    name = cls.removeprefix("__main__.")
    how = ("pass --factory MOD:FN (a function returning the model) to re-run the step, or, "
           "where it is defined (a notebook), replay.replay(path, factory=")
    if isinstance(model.get("default_factory"), str):
        return f"{how}that_function)"
    if (spawned := spawned_advice(meta)) is not None:  # (__mp_main__: replay.spawned_class)
        return spawned
    if cls.startswith("__main__.") and "<locals>" not in name:
        return (f"the model's class {name} was defined in __main__ (a notebook cell or the "
                f"script run), which no import reaches by that name: {how}{name})")
    return f"{how}that_function)"


def kept_init(meta: dict[str, Any]) -> dict[str, Any] | None:
    """The constructor arguments the model kept as data (``recorder.config_args``), if any."""
    init = (meta.get("model") or {}).get("init")
    ok = isinstance(init, dict) and isinstance(init.get("class"), str) and init.get("args")
    return init if ok else None


def _build_without_factory(step: Step, factory_kwargs: dict[str, Any] | None,
                           trusted: bool = False) -> None:
    """A run recorded without ``factory``: the model's class called with the constructor
    arguments it kept as data (``replay.config_args``), or with no arguments, when the
    recorder found that it can be (``default_factory``), under the trust rule of a recorded
    factory; else (or when that builds another model) nothing is re-run and the report says
    what the recorder saw."""
    guess = (step.meta.get("model") or {}).get("default_factory")
    how = _how(step.meta)
    if (init := kept_init(step.meta)) is not None and not factory_kwargs:
        try:
            _build_init(step, init, how, trusted)
            return
        except _InitFailed as e:  # (the kept values are no arguments: try the class bare)
            if not isinstance(guess, str):
                raise FactoryRefused(str(e)) from None
            step.problems.append(str(e))
    how = missing_note((step.meta.get("model") or {}).get("init")) + how
    if not isinstance(guess, str) and not factory_kwargs \
            and (stock := stock_factory(step.meta)) is not None:
        _build_stock(step, stock, how)
        return
    if not isinstance(guess, str) or factory_kwargs:
        raise FactoryRefused(f"{NO_FACTORY}, so nothing was re-run: {how}")
    try:
        with recorded_argv(step.meta, guess):
            step.default_args = True
            _build(step, guess, False, {})
    except FactoryRefused as e:  # (not under the current directory: name the run's)
        raise FactoryRefused(f"{e}{ran_in(step.meta)}") from None
    except ReplayError as e:
        raise FactoryRefused(
            f"the bundle names no model factory, and its model's class called with no "
            f"arguments ({guess}()) does not rebuild it ({one_line(e, 200)}): {how}") from None
    step.problems.append(
        f"the bundle names no model factory: the model was rebuilt as {guess}() with its "
        "default arguments, the weights from the bundle; if the run built it otherwise, "
        f"{how}")


def _build_init(step: Step, init: dict[str, Any], how: str, trusted: bool) -> None:
    """The model's class called with the arguments it kept (``self.config``)."""
    spec = init["class"]
    call = f"{spec}({', '.join(f'{k}=self.{k}' for k in init['args'])})"
    try:
        with recorded_argv(step.meta, spec):
            try:
                cls = resolve_factory(spec, explicit=trusted,
                                      where=where_advice(step.meta, spec, step.path))
            except ReplayError as e:  # (not under the current directory, not importable:
                # our own one line, whose end says what to pass; a long path must not cut it)
                raise FactoryRefused(
                    f"{NO_FACTORY}; the model would be rebuilt as {call} from the constructor "
                    f"arguments the bundle keeps, but {one_line(e, 2000)}{ran_in(step.meta)}"
                ) from None
            _build_with(step, init_factory(init, cls, trusted), spec, {})
    except FactoryRefused:
        raise
    except ReplayError as e:
        raise _InitFailed(
            f"{NO_FACTORY}, and its model's class called with the constructor arguments it "
            f"kept as data ({call}) does not rebuild it ({one_line(e, 200)}): {how}") from None
    step.problems.append(
        f"{NO_FACTORY}: the model was rebuilt as {call}, the constructor arguments the model "
        "kept as data, the weights from the bundle")


def ran_in(meta: dict[str, Any]) -> str:
    """`` (the run ran in DIR)``: where the run's modules import from, for a refusal."""
    ran = (meta.get("env") or {}).get("cwd")
    return f" (the run ran in {ran})" if isinstance(ran, str) else ""


class _InitFailed(ReplayError):
    """The class called with the arguments it kept raised, or built another model."""


def _build_stock(step: Step, stock, how: str) -> None:
    """The model of torch.nn's own modules, rebuilt from the bundle (``replay.stock_model``)."""
    try:
        _build_with(step, stock, "torch.nn", {})
    except ReplayError as e:  # (NotStock too)
        raise FactoryRefused(f"{NO_FACTORY}, and its model of torch.nn's own modules was not "
                             f"rebuilt from the bundle ({one_line(e, 200)}): {how}") from None
    step.problems.append(
        f"{NO_FACTORY}: the model, made of torch.nn's own modules only, was rebuilt from the "
        "bundle's description of them (their classes and arguments), the weights from the "
        "bundle")


def _build(step: Step, spec, explicit: bool, factory_kwargs: dict[str, Any] | None) -> None:
    if callable(spec):  # replay.replay(path, factory=Net) in the notebook that defines it
        name = f"{getattr(spec, '__module__', '?')}:{getattr(spec, '__qualname__', spec)}"
        return _build_with(step, spec, name, factory_kwargs)
    where = where_advice(step.meta, spec, step.path)  # (the run imported it elsewhere)
    _build_with(step, resolve_factory(spec, explicit=explicit, where=where), spec,
                factory_kwargs)


def _build_with(step: Step, fn, spec: str, factory_kwargs: dict[str, Any] | None) -> None:
    meta = step.meta
    kwargs = factory_kwargs if factory_kwargs is not None else meta.get("factory_kwargs") or {}
    step.factory_kwargs = dict(kwargs)
    kwargs, left_out = taken_kwargs(fn, kwargs, spec)  # (a sweep's trial.params: lr, ...)
    if left_out:
        step.problems.append(left_out)
    # Build on the meta device so loading the bundle's weights does not hold two copies; fall
    # back to a real build for factories that need real tensors.
    try:
        made = _call_factory(fn, spec, kwargs, on_meta=True)
        if _meta_attributes(made["model"]):
            raise _MetaUnsupported
    except _MetaUnsupported:
        made = _call_factory(fn, spec, kwargs, on_meta=False)
    model = decompile(made["model"])  # a compiled model's layers re-run one by one
    check_patched_forwards(meta, model)  # (a trainer's patch the factory did not apply)
    step.rebuild = lambda: remember(_call_factory(fn, spec, kwargs, on_meta=False)["model"])
    if edits := code_edits(meta):  # (said first: it explains what follows)
        step.code_edits = edits
        step.problems.append(edits_text(step))
    factory_params = dict(model.named_parameters(remove_duplicate=False))
    load_weights(step, model)
    rebind_loss_params(made.get("loss_fn"), factory_params, model)  # (a decay's list of them)
    step.written = [n for n in meta.get("written_in_step") or () if isinstance(n, str)]
    if refilled := refill_written(step, model, step.written):  # (NaN the step's code wrote)
        step.problems.append(refilled)
    if restored := restore_attributes(meta, model):
        step.problems.append(restored_note(restored))
    step.trained = restore_trained(meta, step.tensors, model)  # (another optimizer's tensors)
    step.built_otherwise = built_otherwise(meta, model)
    step.model = remember(model)  # (an exported GraphModule's lines: replay.fx_lines)
    step.loss_fn = made.get("loss_fn")
    if step.loss_fn is None:
        try:
            step.loss_fn = rebuild_loss(meta.get("loss"), step.tensors, step.device, model)
            restored = restored_loss_attributes(rng_state(step), step.loss_fn)
            if step.loss_fn is not None and (kept := kept_defaults(meta.get("loss"), restored)):
                step.problems.append(kept)
        except Unrebuildable as e:
            step.loss_unrebuilt = str(e)
            step.problems.append(str(e))
    step.unrestored = other_kinds(rng_state(step), model_generators(model, step.loss_fn))
    if odd := other_kinds_note(step.unrestored):
        step.problems.append(odd)
    attach_loss_params(step)  # (those the optimizer trained, before it is rebuilt over them)
    opt_factory = made.get("optimizer")
    step.optimizer = build_optimizer(step, model, opt_factory)


def _call_factory(fn, spec: str, kwargs: dict[str, Any], on_meta: bool) -> dict[str, Any]:
    def call():
        made = fn(**kwargs)
        if isinstance(made, nn.Module):
            return {"model": made}
        if isinstance(made, dict) and isinstance(made.get("model"), nn.Module):
            return made
        raise ReplayError(f"factory {spec!r} returned {type(made).__name__}; it must return an "
                          "nn.Module or a dict with 'model' (and optionally 'loss_fn', "
                          "'optimizer')")

    try:
        if on_meta:
            with torch.device("meta"):
                return call()
        return call()
    except ReplayError:
        raise
    except Exception as e:
        if on_meta:
            raise _MetaUnsupported from None
        given = f" with factory_kwargs {json.dumps(kwargs, default=repr)}" if kwargs else ""
        raise ReplayError(f"factory {spec!r} failed{given} ({type(e).__name__}: {e}); pass "
                          "--factory MOD:FN (and --factory-kwargs) that builds the recorded "
                          "model") from None


class _MetaUnsupported(Exception):
    """The factory cannot build on the meta device; build it for real instead."""


def _meta_attributes(model: nn.Module) -> bool:
    """Plain tensor attributes (neither parameter nor buffer) left on the meta device."""
    return any(isinstance(v, torch.Tensor) and v.is_meta
               for m in model.modules() for v in vars(m).values())
