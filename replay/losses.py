"""Rebuilding the recorded loss from its description in the bundle (``recorder.lossdesc``).

A loss class or function is imported by its recorded ``module:qualname`` under the trust rule
(``replay.trust``: from under the current directory or an installed package, never unpickled).
A class whose constructor needs arguments is not called: the object is made with
``cls.__new__`` and ``nn.Module.__init__``; one whose arguments all have defaults is built with
``cls()``. Either way the recorded attributes, tensors and submodules are then set on it, so it
is the loss that ran. What cannot be rebuilt is said once, in one true sentence, with the way
to make it replayable.
"""

from __future__ import annotations

import functools
import inspect
from pathlib import Path
from typing import Any

import torch
from torch import nn

from recorder.compat import compiled_original
from recorder.validate import import_object

from .attributes import SPELT, as_built
from .compat import remove_member
from .loss_network import network_hint
from .memory_bank import held_bank_hint
from .model_globals import with_model_globals
from .trust import defined_in, installed_roots, module_origin, trusted_path

_FACTORY_WAY = "or return it from the factory as {'model': ..., 'loss_fn': ...}"


class Unrebuildable(Exception):
    """The recorded loss cannot be rebuilt; the message says why and what to do."""


def rebuild_loss(info: dict[str, Any] | None, tensors: dict[str, torch.Tensor],
                 device: torch.device, model: nn.Module | None = None):
    """The loss described by the bundle's ``loss`` entry, or None when there is none to re-run
    (no loss recorded, or one given to ``record_loss``). A submodule the loss shared with the
    model (``"model": NAME``) is ``model``'s, as in the run: its calls from the loss are the
    model's module calls, which the re-run watches as the recorder did. Raises
    :class:`Unrebuildable`."""
    if not info or info.get("kind") == "recorded":
        return None
    kind = info.get("kind")
    if kind == "function":  # (one calling the model through a global: the rebuilt one)
        return with_model_globals(_function(info), info, model)
    if kind == "module" and isinstance(info.get("tree"), dict):
        shared = dict(model.named_modules()) if model is not None else {}
        modes = [(m, m.training) for m in shared.values()]
        try:
            # a loss that is a submodule of the model (a LightningModule's ``self.loss``,
            # into which pytorch-forecasting's forward writes state: a distribution loss's
            # ``_transformation``) is rebuilt into the rebuilt model's own, so what the
            # re-run's forward sets on it is there when the loss runs, as in the run
            own = shared.get(info["tree"].get("model"))
            return _module(info["tree"], tensors, device, top=True, shared=shared,
                           into=own if isinstance(own, nn.Module) else None)
        finally:  # (the loss's train() reached its shared modules: theirs are as recorded)
            for m, was in modes:
                m.training = was
    if kind == "module" and isinstance(info.get("class"), str):
        return _builtin_module(info, tensors, device)  # a bundle from before "tree"
    raise Unrebuildable(f"the bundle's loss entry is not one the recorder writes (kind "
                        f"{kind!r}); {_FACTORY_WAY[3:]}")


def kept_defaults(info: dict[str, Any] | None, restored=frozenset()) -> str | None:
    """A note on the rebuilt loss's attributes the bundle could not store, which its class's
    default construction set (a ``torch.device``, a NumPy scalar): the re-run uses those
    values, which may not be the run's. None when there are none. ``restored``: attributes
    whose state the bundle holds elsewhere (a ``torch.Generator``'s, in its RNG states). The submodules it shares
    with the model are left out: the re-run gives it the factory's (a sentence-transformers
    loss holding its ``SentenceTransformer``, whose tokenizer no bundle stores)."""
    found: list[str] = []

    def walk(node, prefix: str) -> None:
        found.extend(f"{prefix}{a}" for a in node.get("unrecorded", ())
                     if f"{prefix}{a}".partition(" (")[0] not in restored)
        for k, child in node.get("children", {}).items():
            # (a submodule the loss shares with the model, ``Loss(model)`` itself, is the
            # factory's rebuilt module in the re-run, not one the loss's construction made)
            if isinstance(child, dict) and not isinstance(child.get("model"), str):
                walk(child, f"{prefix}{k}.")

    if info and isinstance(info.get("tree"), dict):
        walk(info["tree"], "")
    if not found:
        return None
    return (f"the loss's attribute(s) {', '.join(found[:3])} could not be stored in the bundle "
            "(not JSON values, tensors, modules or importable functions): the re-run uses what "
            "the loss class's default construction sets, which may not be the run's; make them "
            f"such values, {_FACTORY_WAY}")


def _function(info: dict[str, Any]):
    name = info.get("name") or "?"
    spec = info.get("import")
    if isinstance(spec, str) and isinstance(info.get("method"), str):
        return _method(_import(spec, f"class of the loss method {name}"), info)
    if isinstance(spec, str):  # (run eagerly: the name may hold a @torch.compile'd function)
        fn = compiled_original(_import(spec, f"loss function {name}"))
        bound = info.get("partial")
        if isinstance(bound, dict):
            return functools.partial(fn, *bound.get("args", []), **bound.get("keywords", {}))
        return fn
    if name.startswith("torch.nn.functional."):  # a bundle from before "import"
        fn = getattr(torch.nn.functional, name.rpartition(".")[2], None)
        if fn is not None:
            return fn
    raise Unrebuildable(_why(info, f"the loss function {name}", "def lm_loss(out, target): ..."))


def _method(cls, info: dict[str, Any]):
    """The recorded method of an instance of ``cls`` made without calling its constructor,
    its attributes set as recorded (``losses.NCC(win=9).loss``: ``win`` 9)."""
    try:
        obj = cls.__new__(cls)
        tuples = set(info.get("tuples") or [])
        for k, v in (info.get("state") or {}).items():
            object.__setattr__(obj, k, tuple(v) if k in tuples else v)
        for k, held in (info.get("objects") or {}).items():  # (``self.stats = Ema()``)
            object.__setattr__(obj, k, _held_object(held, info.get("name")))
        return getattr(obj, info["method"])
    except Unrebuildable:
        raise
    except Exception as e:
        raise Unrebuildable(f"the loss method {info.get('name')} cannot be rebuilt on an "
                            f"instance of its class ({type(e).__name__}: {e}) "
                            f"{_FACTORY_WAY[3:]} to replay it") from None


def _set_held(m: nn.Module, node: dict[str, Any], name: str) -> None:
    """The functions and plain objects the loss (or submodule) ``m`` held, set back on it."""
    for k, ref in node.get("functions", {}).items():
        _set_plain(m, k, _import(ref, f"function {ref} the loss {name} holds"))
    for k, held in node.get("objects", {}).items():
        _set_plain(m, k, _held_object(held, name))


def _held_object(held: dict[str, Any], name: str):
    """An attribute of the loss that is a plain object (``recorder.lossdesc._plain_object``),
    made again without its constructor: its recorded attributes, JSON values and functions."""
    spec = held.get("import")
    cls = _import(spec, f"class {spec} of an object the loss {name} holds")
    obj = cls.__new__(cls)
    tuples = set(held.get("tuples") or [])
    for k, v in (held.get("state") or {}).items():
        object.__setattr__(obj, k, tuple(v) if k in tuples else v)
    for k, ref in (held.get("functions") or {}).items():
        object.__setattr__(obj, k, _import(ref, f"function {ref} the loss {name} holds"))
    return obj


def _why(info: dict[str, Any], what: str, example: str) -> str:
    why, where = info.get("why"), info.get("defined")
    at = f" ({where})" if where else ""
    reason = {
        "lambda": f"is a lambda{at}, which no import path leads to",
        "closure": f"is defined inside another function{at}, which no import path leads to",
        "script": f"is defined in the training script that ran as __main__{at}, whose "
                  "training is not under `if __name__ == \"__main__\":`, so nanreplay does "
                  "not import it (that would run the training)",
        "partial": f"is a functools.partial{at} of a function that cannot be imported, or "
                   "with arguments that are not JSON values",
        "scripted": "is a TorchScript module, which nanreplay cannot rebuild from the bundle",
    }.get(why, f"cannot be imported by its name{at}")
    if why == "scripted":
        return f"{what} {reason}, so the loss was not re-run; {_FACTORY_WAY[3:]} to replay it"
    guard = "put the training under that guard, or " if why == "script" else ""
    return (f"{what} {reason}, so the loss was not re-run; {guard}define it at module level in "
            f"a module importable from here ({example}) {_FACTORY_WAY} to replay it")


def _import(spec: str, what: str):
    """``module:qualname`` imported, when it lives under the current directory or in an
    installed package and the object found is defined there too."""
    mod, _, attr = spec.partition(":")
    roots = [Path.cwd(), *installed_roots()]
    if not mod or not attr or not trusted_path(module_origin(mod), roots):
        raise Unrebuildable(f"the {what} is in {mod!r}, which is neither under the current "
                            f"directory ({Path.cwd()}) nor an installed package, so nanreplay "
                            f"does not import it; run from the directory that holds it "
                            f"{_FACTORY_WAY}")
    try:
        obj = import_object(mod, attr)
    except Exception as e:
        raise Unrebuildable(f"the {what} cannot be imported as {spec} ({type(e).__name__}: "
                            f"{e}); run from the directory that holds it {_FACTORY_WAY}") from None
    if not trusted_path(defined_in(obj), roots):
        raise Unrebuildable(f"the recorded path {spec} of the {what} leads to "
                            f"{getattr(obj, '__module__', '?')}."
                            f"{getattr(obj, '__qualname__', '?')}, defined outside the current "
                            f"directory and installed packages; nanreplay does not call it")
    return obj


def _module(node: dict[str, Any], tensors, device, *, top: bool = False,
            shared: dict[str, nn.Module] | None = None, into: nn.Module | None = None
            ) -> nn.Module:
    """The loss (``top``) or one of its submodules, rebuilt from its bundle node: into
    ``into``, the submodule its parent's default construction made there, when it is of the
    recorded class, so that what that construction wired to it stays (forward hooks a
    perceptual loss registers on its extractor's layers to tap their features)."""
    shared = shared or {}
    if not top and isinstance(own := shared.get(node.get("model")), nn.Module):
        return own
    name = node.get("class", "?")
    what = f"the loss {name}" if top else f"the loss's submodule {name}"
    spec = node.get("import")
    if isinstance(spec, str):
        cls = _import(spec, f"loss class {name}")
    elif into is not None and _class_name(type(into)) == name:
        # a class made at run time, which no import path leads to (parametrize's
        # ParametrizedConv1d under weight_norm or spectral_norm): the parent's own
        # construction made it again, so the recorded state goes into that one
        cls = type(into)
    else:
        raise Unrebuildable(_why(node, what, "class MyLoss(nn.Module): ..."))
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise Unrebuildable(f"the recorded loss class {spec} is not an nn.Module subclass; "
                            f"{_FACTORY_WAY[3:]}")
    config = _plain({k: tuple(v) if k in node.get("tuples", ()) else v
                     for k, v in node.get("config", {}).items()})
    m = into if into is not None and type(into) is cls else _instance(cls, config)
    for k, v in config.items():
        _set_plain(m, k, _as_recorded(m, k, v))
    for k, key in node.get("tensors", {}).items():
        _set_plain(m, k, _tensor(tensors, key, device, name))
    for k, key in node.get("arrays", {}).items():  # NumPy arrays, as the loss held them
        _set_plain(m, k, _array(_tensor(tensors, key, torch.device("cpu"), name), what, k))
    _set_held(m, node, name)
    skip = set(node.get("non_persistent", ()))
    for k, key in node.get("buffers", {}).items():
        _clear(m, k)
        m.register_buffer(k, None if key is None else _tensor(tensors, key, device, name),
                          persistent=k not in skip)
    frozen = set(node.get("frozen", ()))
    for k, key in node.get("params", {}).items():
        _clear(m, k)
        m.register_parameter(k, None if key is None else nn.Parameter(
            _tensor(tensors, key, device, name), requires_grad=k not in frozen))
    for k, child in node.get("children", {}).items():
        made = getattr(m, k, None)  # (type-checked in _module)
        _clear(m, k)
        m.add_module(k, None if child is None else _module(child, tensors, device,
                                                            shared=shared, into=made))
    _drop_unrecorded(m, node)
    # each node's own recorded mode, not train()'s recursion, which would put a child's eval
    # mode (a perceptual loss's extractor, set eval in its __init__) back to training
    m.training = bool(node.get("training", True))
    lost = [a for a in node.get("unrecorded", ()) if not hasattr(m, a.split(" ")[0])]
    if lost:  # (one its default construction set is kept)
        raise Unrebuildable(_unstored(what, lost))
    return m


def _unstored(what: str, lost: list[str]) -> str:
    """Why the loss was not rebuilt: the attributes the bundle could not store, and for a
    function no import path leads to (a lambda ``distance_function``), where to define it."""
    fn = any(w in a for a in lost for w in (" (a lambda", " (a function"))
    return (f"{what} holds attribute(s) the bundle cannot store ({', '.join(lost[:3])}: not "
            "JSON values, tensors, modules or importable functions), so it was not rebuilt; "
            + ("define that function at module level in a module importable from here (def "
               "distance(a, b): ...) " + _FACTORY_WAY if fn else _FACTORY_WAY[3:]))


def _drop_unrecorded(m: nn.Module, node: dict[str, Any]) -> None:
    """Remove the submodules, parameters and buffers the class's default construction made
    that the recorded module did not hold (a distillation loss's teacher network built
    shallower than its class's defaults, ``SweepNet(n_layers=1)``: the defaults' extra layers
    would run after the recorded ones, which ``add_module`` puts last)."""
    for table, names in (("children", [n for n, _ in m.named_children()]),
                         ("params", [n for n, _ in m.named_parameters(recurse=False)]),
                         ("buffers", [n for n, _ in m.named_buffers(recurse=False)])):
        recorded = node.get(table)
        if isinstance(recorded, dict):
            for k in names:
                if k not in recorded:
                    _clear(m, k)


def _class_name(cls: type) -> str:
    """A class's name as ``recorder.lossdesc`` records it."""
    return f"{cls.__module__}.{cls.__qualname__}"


def _array(t: torch.Tensor, what: str, k: str):
    try:
        return t.numpy()
    except RuntimeError:  # (NumPy is no dependency of nanreplay; the run had it)
        raise Unrebuildable(f"{what} holds a NumPy array ({k}), and NumPy is not installed "
                            "where nanreplay runs: pip install numpy") from None


def _instance(cls: type, config: dict[str, Any]) -> nn.Module:
    """``cls()`` when its constructor needs no argument, or ``cls(**args)`` when each argument
    it needs is a recorded attribute of the same name (``self.layers = layers``), else an
    instance made without calling it (the recorded attributes are set next)."""
    try:
        params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    except (TypeError, ValueError):
        params = None
    named = [p for p in params or () if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    needs = params is None or any(
        p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params)
    given = [p.name for p in named if p.default is p.empty]
    if not needs or (params is not None and given and all(n in config for n in given)
                     and all(p.kind != p.POSITIONAL_ONLY for p in params)):
        try:
            return cls(**{n: config[n] for n in given})
        except Exception:
            pass  # made without it below, like a constructor that needs arguments
    m = cls.__new__(cls)
    nn.Module.__init__(m)
    return m


def _plain(config: dict[str, Any]) -> dict[str, Any]:
    """The recorded attributes as the loss held them (a dict keyed by numbers from its pairs)."""
    return {k: {key: x for key, x in v["$dict"]}
            if isinstance(v, dict) and isinstance(v.get("$dict"), list) else v
            for k, v in config.items()}


def _as_recorded(m: nn.Module, k: str, v):
    """A recorded attribute's value: a non-finite float the loop set (a KL weight of 0/0),
    which the bundle spells 'nan', as a float again."""
    built = vars(m).get(k)
    if built is not None:
        return as_built(v, built)
    return float(v) if isinstance(v, str) and v in SPELT else v


def _clear(m: nn.Module, k: str) -> None:
    """Remove ``k`` wherever the default construction put it, so it can be set as recorded."""
    remove_member(m, k)


def _set_plain(m: nn.Module, k: str, v) -> None:
    _clear(m, k)
    object.__setattr__(m, k, v)


def _tensor(tensors, key: str, device, name: str) -> torch.Tensor:
    if key not in tensors:
        raise Unrebuildable(f"the bundle lacks the tensor {key} of the loss {name} (stripped "
                            "weights?); replay the full bundle")
    return tensors[key].to(device)


def _builtin_module(info: dict[str, Any], tensors, device) -> nn.Module:
    """A ``torch.nn`` built-in from the flat fields bundles had before ``tree``."""
    cls_path = info["class"]
    cls = getattr(nn, cls_path.rpartition(".")[2], None) if cls_path.startswith("torch.nn.") \
        else None
    if cls is None:
        raise Unrebuildable(f"the loss {cls_path} is not a torch.nn built-in and this bundle "
                            f"(from an older recorder) does not say how to import it; "
                            f"{_FACTORY_WAY[3:]}")
    kwargs = {k: v for k, v in info.get("config", {}).items()
              if k in info.get("init_args", []) and k not in ("size_average", "reduce")}
    for b in info.get("buffers", []):
        if b in info.get("init_args", []):
            kwargs[b] = _tensor(tensors, f"loss/{b}", device, cls_path)
    return cls(**kwargs)


def non_finite_loss_state(loss_fn) -> str | None:
    """The loss module's first tensor (buffer, parameter or plain tensor attribute: a class
    ``weight``, a ``pos_weight``) that holds NaN/+-Inf, with its first such entries, in words;
    None when every one is finite. Such a tensor was made so before the step (class weights
    from inverse frequencies with a class absent: 1/0), not by the loss's ops."""
    if not isinstance(loss_fn, nn.Module):
        return None
    own = [*loss_fn.named_buffers(), *loss_fn.named_parameters()]
    own += [(k, v) for k, v in vars(loss_fn).items() if isinstance(v, torch.Tensor)]
    for name, t in own:
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = ~torch.isfinite(t.detach())
            vals = ", ".join(str(v) for v in t.detach()[bad][:3].tolist())
            at = ", ".join(str(tuple(i) if len(i) > 1 else i[0])  # (none for a 0-d one)
                           for i in bad.nonzero()[:3].tolist() if i)
            return f"the loss's {name!r} holding {vals}" + (f" at index {at}" if at else "")
    return None


def held_state_cause(cause, hit, held: str | None, step=None):
    """``cause`` of a loss op ``hit``, or ``weights`` when the op took a non-finite tensor
    of the loss's own (``held``: :func:`non_finite_loss_state`'s words) as the step began; of
    a network's parameters the loss holds, another optimizer's (``replay.loss_network``)."""
    if hit is None or hit.inputs_finite or held is None:
        return cause
    if (network := network_hint(step, hit.op, held)) is not None:
        return type(cause)("weights", network)
    if step is not None and (bank := held_bank_hint(hit.op, step.loss_fn)) is not None:
        return type(cause)("weights", bank)  # (a bank the loss writes rows of: NaN unwritten)
    return type(cause)("weights", f"{hit.op} took {held}, as the step began: a value made "
                       "before the step (class weights 1/count with a class absent from the "
                       "counts: 1/0; an EWC Fisher normalised by its max, 0 for a parameter "
                       "the task never used: 0/0; a centre averaged over an empty loader: "
                       "0/0; a target normaliser's std fitted on a single sample: torch.std's "
                       "n - 1 is 0), not by the loss; make it finite where it is made "
                       "(count.clamp_min(1), a smoothing constant, f / f.max() only where "
                       "f.max() > 0, a check that the loader yielded samples, a std over more "
                       "than one sample)")
