"""The bundle's weights and buffers put into the model the factory built (``replay.load``):
parameters assigned (no second copy), buffers copied; what does not fit says what to pass."""

from __future__ import annotations

import json
import re

import torch
from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.parameter import is_lazy

from recorder.target import LOSS_PREFIX

from .compat import grad_hooks, non_persistent, parameter_like, set_buffer, set_parameter
from .edited_code import edits_text
from .errors import ReplayError
from .held_params import rebind_holders
from .param_store import forget_replaced
from .retie import held_apart, tie_as_recorded
from .train_mode import set_training
from .wrapped_load import as_recorded


def other_model(step) -> str:
    """What to do when the factory's model does not hold the bundle's weights. Mostly it was
    called without the run-time configuration (a --dim flag) that sized the trained model:
    the recorded command line shows it, and --factory-kwargs hands it over."""
    if step.code_edits:  # (not the run's arguments: the run's code)
        return edits_text(step)
    argv = (step.meta.get("env") or {}).get("argv")
    ran = (f"; the run's command line was {' '.join(map(str, argv))!r}"
           if isinstance(argv, list) and argv else "")
    given = (f" (it was called with {json.dumps(step.factory_kwargs, default=repr)})"
             if step.factory_kwargs else "")
    return (f"the factory builds a different model{given}: it cannot see the run's "
            f"configuration (command-line flags, config files){ran}. Pass --factory-kwargs "
            "'{...}' with the settings that built the trained model (record them with "
            "FlightRecorder(..., factory_kwargs={...})), or --factory MOD:FN building it")


_PARAMETRIZED = re.compile(r"^(.*?)parametrizations\.([^.]+)\.original\d*$")


def _parametrized(missing: list[str], have: set[str]) -> str | None:
    """What to do when the bundle's and the factory's parameters differ by a parametrization
    (spectral_norm, weight_norm, orthogonal: the trained tensors of weight ``w`` are
    ``parametrizations.w.original*``): the run added it to the model (or removed it) after the
    factory built it. None when they differ otherwise."""
    for name in missing:
        m = _PARAMETRIZED.match(name)
        if m is not None and m[1] + m[2] in have:
            return (f"the run's model had a parametrization on {m[1] + m[2]!r} (spectral_norm, "
                    "weight_norm, orthogonal) that the factory's model lacks: the training "
                    "script added it after the factory built the model; add it in the factory")
        if any((m := _PARAMETRIZED.match(h)) and m[1] + m[2] == name for h in have):
            return (f"the factory's model has a parametrization on {name!r} that the run's "
                    "model did not (the training script removed it, remove_parametrizations): "
                    "build the model as it was trained in the factory")
    return None


def _wrapped(expected: set[str], have: set[str]) -> str | None:
    """What to do when every parameter of the bundle is one of the factory's model under one
    module path (``_module.0.weight`` for ``0.weight``): the recorder was given a wrapper
    holding the model (Opacus's GradSampleModule keeps it as ``_module``), the factory builds
    what it wraps. None when they differ otherwise."""
    first = min(expected, key=len, default="")
    for i in (i + 1 for i, c in enumerate(first) if c == "."):
        prefix = first[:i]
        if all(n.startswith(prefix) and n[i:] in have for n in expected) \
                and len(expected) == len(have):
            outer = prefix[:-1]
            return (f"every parameter the bundle holds is one of the factory's under "
                    f"{outer!r}: the recorder was given a module that wraps the model as "
                    f"{outer!r} (Opacus's GradSampleModule keeps it as '_module'), and the "
                    f"factory builds the inner model: record the inner model "
                    f"(FlightRecorder(model.{outer}, ...), the same hooks fire) or have the "
                    "factory return the wrapped one")
    return None


def _prune_as_recorded(step, model: nn.Module, missing: list[str], have: set[str]) -> bool:
    """Prune the factory's model as the run's was (``torch.nn.utils.prune``, applied by the
    training loop after the factory built the model: iterative magnitude pruning): each
    missing ``<w>_orig`` whose ``<w>`` the model has and whose ``<w>_mask`` the bundle holds
    gets a pruning mask, which the bundle's then replaces. False when none is such."""
    from torch.nn.utils import prune

    done = []
    for name in missing:
        base = name.removesuffix("_orig")
        if base == name or base not in have or f"buffers/{base}_mask" not in step.tensors:
            continue
        mod_name, _, attr = base.rpartition(".")
        mod = model.get_submodule(mod_name)
        prune.custom_from_mask(mod, attr, torch.ones_like(getattr(mod, attr)))
        done.append(base)
    if done:
        step.problems.append(
            f"the run pruned {', '.join(map(repr, done))} (torch.nn.utils.prune) after the "
            "factory built the model: the replay prunes the factory's model with the bundle's "
            "masks")
    return bool(done)


def load_weights(step, model: nn.Module) -> None:
    """Assign the bundle's tensors as the model's parameters (no second copy) and copies of
    them as its buffers: every training forward writes buffers in place (running statistics),
    and the bundle's values must stay the step's start for every re-run after it (``--try``).
    What updates parameters in place copies them first (``replay.optimizer_origin``)."""
    t, meta, dev = step.tensors, step.meta, step.device
    _shaped_as_recorded(step, model)
    tie_as_recorded(step, model)
    names_by_id = _names_by_id(model)
    expected = {n for n in meta.get("params", []) if not n.startswith(LOSS_PREFIX)}
    have = {n for names in names_by_id.values() for n in names}
    missing = sorted(n for n in expected if n not in have)
    if missing and _prune_as_recorded(step, model, missing, have):
        load_weights(step, model)
        return
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ReplayError(f"the model from the factory has no parameter {missing[0]!r}{more} "
                          "that the bundle holds; "
                          + (_parametrized(missing, have) or _wrapped(expected, have)
                             or other_model(step)))
    done: dict[int, nn.Parameter] = {}
    replaced: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # the factory's, by id
    regrown: list[str] = []  # replaced by the loop with another shape (see below)
    # modules the recorded model held on the meta device: placeholders (a hypernetwork's main
    # network, whose weights functional_call swaps in at every call)
    placeholders = {m["name"] for m in meta.get("modules", []) if m.get("device") == "meta"}
    # (listed first: a shared module yields its parameters twice, the 2nd time replaced)
    for name, p in list(model.named_parameters(remove_duplicate=False)):
        if id(p) in done and not held_apart(step, name):
            assign(model, name, done[id(p)], param=True)
            continue
        src = name if f"weights/{name}" in t else next(
            (n for n in names_by_id[id(p)] if f"weights/{n}" in t), None)
        if src is None and name.rpartition(".")[0] in placeholders:
            continue  # (holding no value, it is not bundled; it stays on the meta device)
        if src is None:
            raise ReplayError(f"the bundle holds no weights for parameter {name!r} of the model "
                              f"from the factory; {other_model(step)}")
        w = as_recorded(step, f"weights/{src}", p)  # (QLoRA's int8 weight: of its own class)
        if tuple(w.shape) != tuple(p.shape) and src in meta.get("replaced_params", ()):
            regrown.append(f"{name} {list(w.shape)} (the factory's {list(p.shape)})")
        elif tuple(w.shape) != tuple(p.shape):
            raise ReplayError(f"weights/{src} has shape {list(w.shape)} in the bundle but "
                              f"{list(p.shape)} in the model from the factory; "
                              + other_model(step))
        new = parameter_like(p, w.to(dev))
        _keep_hooks(p, new)
        done[id(p)] = new
        replaced[id(p)] = (p, new)
        assign(model, name, new, param=True)
    rebind_holders(model, replaced)  # (Keras's variables hold them too)
    _say_regrown(step, regrown)
    forget_replaced(set(done))  # (Pyro's store would hand the factory's back: param_store)
    _load_buffers(step, model)
    set_training(model, meta.get("model", {}).get("training", True))
    flags = {m["name"]: m.get("training") for m in meta.get("modules", [])}
    for name, m in model.named_modules():
        if flags.get(name) is not None:
            m.training = flags[name]


def _shaped_as_recorded(step, model: nn.Module) -> None:
    """Lazy modules (``nn.LazyLinear``) as the recorded run's first forward initialized them:
    their parameters and buffers given the bundle's shapes, and the sizes that forward inferred
    (``in_features``) the run's, as the bundle's modules had them when the recorder attached
    (after that forward: see ``recorder.lazy_init``). They become the plain classes at the
    re-run's first forward."""
    t, at_attach = step.tensors, {info.get("name"): info.get("attrs_at_attach")
                                  for info in step.meta.get("modules") or ()}
    for name, m in model.named_modules():
        if not isinstance(m, LazyModuleMixin) or not m.has_uninitialized_params():
            continue
        for kind, named in (("weights", m.named_parameters), ("buffers", m.named_buffers)):
            for k, x in named(prefix=name, recurse=False):
                if is_lazy(x) and (w := t.get(f"{kind}/{k}")) is not None:
                    x.materialize(w.shape, device=x.device, dtype=w.dtype)  # (meta: see load)
        attrs = at_attach.get(name)
        for k, v in (attrs.items() if isinstance(attrs, dict) else ()):
            if type(v) is int and type(vars(m).get(k)) is int:  # (in_features, num_features)
                setattr(m, k, v)


def _say_regrown(step, regrown: list[str]) -> None:
    """The note for parameters the recorder saw the loop swap for new ones of another shape
    (``meta["replaced_params"]``: densification), which the re-run takes from the bundle."""
    if regrown:
        step.problems.append(
            f"parameter {regrown[0]}"
            + (f" and {len(regrown) - 1} more were" if len(regrown) > 1 else " was")
            + " replaced by the training loop with another shape (densified or pruned "
            "Gaussians, a resized embedding): the re-run uses the bundle's")


def _keep_hooks(old: nn.Parameter, new: nn.Parameter) -> None:
    """The gradient hooks the factory's model put on parameter ``old`` (an embedding's
    gradient normalised per row, a clamp), on ``new`` too: they are part of the step's
    gradient. (Post-accumulate hooks are not: they act after it, an optimizer stepping in
    backward, which would write the bundle's weights.)"""
    if not new.requires_grad:
        return
    for hook in grad_hooks(old).values():
        new.register_hook(hook)


def _load_buffers(step, model: nn.Module) -> None:
    """Copies of the bundle's buffers as the model's (see :func:`load_weights`)."""
    t, meta, dev = step.tensors, step.meta, step.device
    model_buffers = dict(model.named_buffers(remove_duplicate=False))
    resized: list[str] = []
    for name in meta.get("buffers", []):
        key = f"buffers/{name}"
        if key not in t:
            continue
        if name not in model_buffers:
            raise ReplayError(f"the model from the factory has no buffer {name!r} that the "
                              f"bundle holds; {other_model(step)}")
        b, have = t[key], model_buffers[name]
        # The parameters matched: a buffer of another shape is one the forward resizes (a
        # quantization observer's per-channel scale, a cache it grew), and the bundle's is
        # what ran. Said when persistent: a buffer sized by the configuration looks alike.
        if tuple(b.shape) != tuple(have.shape) and not non_persistent(model, name):
            resized.append(f"{name} {list(b.shape)} (the factory's {list(have.shape)})")
        assign(model, name, b.to(dev, copy=True), param=False)
    if resized:
        step.problems.append(
            f"buffer {resized[0]}{f' and {len(resized) - 1} more' if len(resized) > 1 else ''}"
            " ran with another shape than the factory's model gives it: the re-run uses the "
            "bundle's (a buffer the forward resizes, such as a quantization observer's); if "
            "the configuration sizes it, pass --factory-kwargs with the run's settings")
    for name, b in model.named_buffers():
        if b.is_meta:
            raise ReplayError(f"buffer {name!r} of the model is not in the bundle; "
                              + other_model(step))


def _names_by_id(model: nn.Module) -> dict[int, list[str]]:
    """Every name of each parameter (a tied one has two), by its id."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def assign(model: nn.Module, name: str, value, *, param: bool) -> None:
    """``value`` as the parameter (or buffer) ``name`` (dotted) of ``model``, no copy made."""
    mod_name, _, attr = name.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    (set_parameter if param else set_buffer)(mod, attr, value)
