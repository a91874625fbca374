"""The model of a bundle recorded without a factory whose modules are all PyTorch's own
(``recorder.stock_model``: an ``nn.Sequential`` of ``nn.Linear`` and ``nn.ReLU`` made in a
notebook), rebuilt from the bundle's description: each class imported from ``torch.nn`` alone,
called with its recorded attributes that its constructor takes (``in_features``,
``kernel_size``, ``normalized_shape``), the others set as recorded, its children rebuilt the
same way, the parameters the bundle does not hold left out (``bias=False``) and the tensors
the run reached under two names tied again (``head.weight = emb.weight``). The weights are then
the bundle's (``replay.load``). A description that names any other class, or that a
constructor refuses, or a module its attributes cannot rebuild (``nn.TransformerEncoderLayer``
keeps ``d_model`` in no attribute) rebuilds nothing, and the reason names the module. torch's
own reparametrizations the run had put on a module (``applied``: weight_norm, spectral_norm,
orthogonal, new or hook-based) are applied again by their public functions, with their
recorded arguments, before the weights are loaded."""

from __future__ import annotations

import importlib
import inspect
import re
import warnings
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrizations

from recorder.stock_model import STOCK

from .errors import ReplayError

# recorder.stock_model's names of torch's reparametrizations: the function applying each
APPLY = {
    "weight_norm": parametrizations.weight_norm,
    "spectral_norm": parametrizations.spectral_norm,
    "orthogonal": parametrizations.orthogonal,
    "hooked_weight_norm": nn.utils.weight_norm,
    "hooked_spectral_norm": nn.utils.spectral_norm,
}
_PLAIN = (int, float, str, bool, type(None))


class NotStock(ReplayError):
    """The description names a class outside ``torch.nn.modules``, is malformed, or holds
    arguments a constructor refuses (raised as it is, not as a failed factory call)."""


def stock_factory(meta: dict[str, Any]):
    """A factory (no arguments) building the bundle's model from its description, or None when
    the bundle holds none."""
    tree = (meta.get("model") or {}).get("stock")
    if not isinstance(tree, dict):
        return None
    params = {n for n in meta.get("params", ()) if isinstance(n, str)}
    buffers = {n for n in meta.get("buffers", ()) if isinstance(n, str)}
    return partial(_build, tree, params, buffers)


def _build(tree: dict[str, Any], params: set[str], buffers: set[str]) -> nn.Module:
    model = _module(tree, "", params, buffers)
    tied = tree.get("tied") or {}
    if not isinstance(tied, dict):
        raise NotStock("a malformed module description")
    for alias, src in tied.items():  # (built apart: one tensor again, as in the run)
        owner, _, leaf = alias.rpartition(".") if isinstance(alias, str) else ("", "", "")
        try:
            m = model.get_submodule(owner)
            if src in params:
                m.register_parameter(leaf, model.get_parameter(src))
            else:
                m.register_buffer(leaf, model.get_buffer(src))
        except (AttributeError, KeyError, TypeError) as e:
            raise NotStock(f"the tie of {alias!r} to {src!r} is not the model's ({e})") from None
    return model


def _module(node: Any, prefix: str, params: set[str], buffers: set[str]) -> nn.Module:
    if not isinstance(node, dict) or not isinstance(node.get("config", {}), dict) \
            or not isinstance(node.get("children", {}), dict):
        raise NotStock("a malformed module description")
    cls = _class(node.get("class"))
    config = _config(node)
    where = f"{node['class']} ({f'module {prefix[:-1]!r}' if prefix else 'the model'})"
    m, passed = _construct(cls, config, where)
    for k, v in config.items():
        if k not in passed and not k.startswith("_"):
            setattr(m, k, v)
    for k, child in node.get("children", {}).items():
        m.add_module(k, None if child is None else _module(child, f"{prefix}{k}.", params,
                                                            buffers))
    _apply(m, node.get("applied") or [], where)
    for k in [k for k, p in m.named_parameters(recurse=False) if f"{prefix}{k}" not in params]:
        m.register_parameter(k, None)  # (built by default, absent in the run: bias=False)
    for k in [k for k, b in m.named_buffers(recurse=False) if f"{prefix}{k}" not in buffers]:
        m.register_buffer(k, None)
    _check_held(m, prefix, params | buffers, where)
    return m


def _apply(m: nn.Module, applied: Any, where: str) -> None:
    """Applies each of torch's reparametrizations described in ``applied`` to ``m``."""
    if not isinstance(applied, list):
        raise NotStock("a malformed module description")
    for d in applied:
        fn = APPLY.get(d.get("apply")) if isinstance(d, dict) else None
        args, tensor = (d.get("args"), d.get("tensor")) if fn else (None, None)
        if not isinstance(args, dict) or not isinstance(tensor, str) \
                or not all(isinstance(k, str) and isinstance(v, _PLAIN) for k, v in args.items()):
            raise NotStock(f"{where}: a malformed reparametrization {d!r}")
        try:
            with warnings.catch_warnings():  # (the hook-based ones are deprecated)
                warnings.simplefilter("ignore", FutureWarning)
                fn(m, tensor, **args)
        except (TypeError, ValueError, RuntimeError, AttributeError) as e:
            if any(t.is_meta for t in m.parameters()):  # (orthogonal's right_inverse reads
                raise  # values: built again for real, replay.load)
            raise NotStock(f"{where}'s {d['apply']} of {tensor!r} was not applied again "
                           f"({type(e).__name__}: {e})") from None


def _check_held(m: nn.Module, prefix: str, held: set[str], where: str) -> None:
    """Refuses a module built without a tensor the bundle holds for it: one an argument kept
    in no attribute makes (``nn.MultiheadAttention``'s ``add_bias_kv``)."""
    have = {k for k, _ in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]}
    if lacking := sorted(n[len(prefix):] for n in held if n.startswith(prefix)
                         and "." not in n[len(prefix):] and n[len(prefix):] not in have):
        raise NotStock(f"{where} is built without its {', '.join(map(repr, lacking))}, which "
                       "the bundle holds: the constructor argument that makes it is kept in no "
                       "attribute")


def _config(node: dict[str, Any]) -> dict[str, Any]:
    """The recorded attributes as they were: tuples, ``torch.Size``s and non-finite floats
    (which JSON holds as lists and strings)."""
    tuples, sizes, floats = (set(node.get(k) or ()) for k in ("tuples", "sizes", "floats"))
    config = {}
    for k, v in node.get("config", {}).items():
        if not isinstance(k, str):
            continue
        if k in sizes and isinstance(v, list) and all(type(x) is int for x in v):
            v = torch.Size(v)
        elif k in tuples and isinstance(v, list):
            v = tuple(v)
        elif k in floats and v in ("inf", "-inf", "nan"):
            v = float(v)
        config[k] = v
    return config


def _construct(cls: type, config: dict[str, Any], where: str) -> tuple[nn.Module, set[str]]:
    """``cls`` called with the recorded attributes its constructor takes by name and that
    differ from their defaults (an argument ``nn.GRU`` refuses even at its default,
    ``proj_size``, is then left out), and the names passed."""
    accepted, own = _accepted(cls)
    if missing := [k for k in own if k not in config]:
        raise NotStock(f"{where} keeps its constructor's {', '.join(map(repr, missing))} in "
                       "no plain attribute, so it cannot be rebuilt from the bundle")
    kwargs = {k: v for k, v in config.items() if k in accepted
              and not (type(v) is type(accepted[k]) and v == accepted[k])}
    while True:
        try:
            return cls(**kwargs), set(kwargs)
        except TypeError as e:  # (nn.LSTM passes its base's mode itself: set after instead)
            twice = re.search(r"got multiple values for argument '(\w+)'", str(e))
            if twice is None or twice.group(1) not in kwargs:
                raise NotStock(f"{where} was not rebuilt from its recorded attributes "
                               f"({type(e).__name__}: {e})") from None
            del kwargs[twice.group(1)]
        except ValueError as e:
            raise NotStock(f"{where} was not rebuilt from its recorded attributes "
                           f"({type(e).__name__}: {e})") from None


def _accepted(cls: type) -> tuple[dict[str, Any], list[str]]:
    """The arguments ``cls``'s constructor takes by name, with their defaults, following
    ``**kwargs`` to the base class's (``nn.LSTM(*args, **kwargs)`` to ``RNNBase``'s), and
    those its own constructor requires."""
    accepted: dict[str, Any] = {}
    own: list[str] | None = None
    for klass in cls.__mro__[:cls.__mro__.index(nn.Module)]:
        if "__init__" not in vars(klass):
            continue
        ps = list(inspect.signature(vars(klass)["__init__"]).parameters.values())[1:]
        named = [p for p in ps if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        for p in named:
            accepted.setdefault(p.name, p.default)
        if own is None:
            own = [p.name for p in named if p.default is p.empty]
        if not any(p.kind is p.VAR_KEYWORD for p in ps):
            break
    return accepted, own or []


def _class(spec: Any) -> type:
    """A class of ``torch.nn.modules`` by its recorded ``module:qualname``."""
    mod, _, name = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if not mod.startswith(STOCK) or not name.isidentifier():
        raise NotStock(f"class {spec!r} is not one of torch.nn's")
    cls = getattr(importlib.import_module(mod), name, None)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)
            and cls.__module__.startswith(STOCK)):
        raise NotStock(f"class {spec!r} is not one of torch.nn's")
    return cls
