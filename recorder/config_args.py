"""The root model's constructor arguments that the instance keeps as data, so that a run
recorded without a factory is rebuilt as it was built: nanoGPT's ``GPT(config)`` with
``self.config = config`` (a dataclass, possibly frozen and nested), ``Net(args)`` keeping an
``argparse.Namespace``, ``Net(cfg)`` an OmegaConf ``DictConfig`` or a dict of lists, a Hugging
Face ``PretrainedConfig``; values inside them may be enum members, paths, dtypes, importable
classes and functions (``act_layer=nn.GELU``) and ``functools.partial``s of them (timm's
``norm_layer=partial(nn.LayerNorm, eps=1e-6)``).

Each value is written as JSON data tagged with its kind; types are named by import path only
(nothing pickled), and the replay imports them under its trust rule (``replay.config_args``).
A constructor argument the instance keeps nowhere by its name, or holds as something else (a
lambda, a tensor), is named instead, so the replay says what to pass.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import functools
import inspect
import math
import types
from pathlib import PurePath
from typing import Any

import torch
from torch import nn

from .lossdesc import describe_callable


class Unstorable(Exception):
    """A value the bundle cannot hold as data; its text says what it is."""


def describe_init(model: nn.Module) -> dict[str, Any] | None:
    """``{"class", "args"}``: the model's class's import path and the arguments its
    constructor takes that the instance holds under the same name, encoded; or ``{"class",
    "missing"}`` naming the required ones it cannot give; None when its class has no import
    path or takes nothing the instance keeps."""
    spec = describe_callable(type(model)).get("import")
    if spec is None or spec.split(".")[0] == "torch":
        return None
    try:
        params = list(inspect.signature(type(model)).parameters.values())
    except (TypeError, ValueError):
        return None
    args: dict[str, Any] = {}
    missing: list[str] = []
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        required = p.default is p.empty
        held = vars(model).get(p.name, _NONE)
        if held is _NONE or p.kind is p.POSITIONAL_ONLY:
            if required:
                missing.append(f"{p.name!r} (kept on the model as no self.{p.name})")
            continue
        try:
            args[p.name] = encode(held)
        except Exception as e:  # (Unstorable; an OmegaConf value left '???' raises its own)
            what = str(e) if isinstance(e, Unstorable) else \
                f"a {type(held).__qualname__} that raised {type(e).__name__} as it was read"
            if required:
                missing.append(f"{p.name!r} (self.{p.name} holds {what}, which is no data)")
    if missing:
        return {"class": spec, "missing": missing}
    return {"class": spec, "args": args} if args else None


_NONE = object()


def encode(v: Any, depth: int = 0) -> Any:
    """``v`` as JSON data: plain scalars as they are, everything else as a tagged dict."""
    if depth > 20:
        raise Unstorable("a structure nested too deep")
    if v is None or isinstance(v, (bool, str)) or type(v) is int:
        return v
    if type(v) is float:
        return v if math.isfinite(v) else {"t": "float", "v": repr(v)}
    if isinstance(v, enum.Enum):  # (before int: an IntEnum is one)
        return {"t": "enum", "class": _import_path(type(v)), "name": v.name}
    if isinstance(v, torch.dtype):
        return {"t": "dtype", "name": str(v).removeprefix("torch.")}
    if isinstance(v, torch.device):
        return {"t": "device", "v": str(v)}
    if isinstance(v, PurePath):
        return {"t": "path", "v": str(v)}
    if type(v) in (list, tuple):
        return {"t": type(v).__name__, "items": [encode(x, depth + 1) for x in v]}
    if isinstance(v, dict) and type(v).__module__ in ("builtins", "collections"):
        return {"t": "dict", "items": [[encode(k, depth + 1), encode(x, depth + 1)]
                                       for k, x in v.items()]}
    if type(v) in (argparse.Namespace, types.SimpleNamespace):
        return {"t": "namespace", "kind": type(v).__module__,
                "items": encode(vars(v), depth + 1)}
    if _generated_init(v):
        return {"t": "dataclass", "class": _import_path(type(v)),
                "fields": {f.name: encode(getattr(v, f.name), depth + 1)
                           for f in dataclasses.fields(v) if f.init}}
    return _encode_library(v, depth)


def _generated_init(v: Any) -> bool:
    """A dataclass instance whose constructor takes its init fields, no others: its fields
    rebuild it (a subclass with an ``__init__`` of its own, as Hugging Face's configs are,
    is not rebuilt from them)."""
    if not dataclasses.is_dataclass(v) or isinstance(v, type) or _library_config(v):
        return False
    try:
        params = inspect.signature(type(v)).parameters
    except (TypeError, ValueError):
        return False
    return set(params) == {f.name for f in dataclasses.fields(v) if f.init}


HF_CONFIGS = {"transformers.configuration_utils.PretrainedConfig",  # (renamed in 5.x)
              "transformers.configuration_utils.PreTrainedConfig"}


def _library_config(v: Any) -> bool:
    return bool(HF_CONFIGS & _mro(v))


def _mro(v: Any) -> set[str]:
    return {f"{c.__module__}.{c.__qualname__}" for c in type(v).__mro__}


def _encode_library(v: Any, depth: int) -> Any:
    """OmegaConf's and Hugging Face's config objects, importable callables and partials."""
    mro = _mro(v)
    if mro & {"omegaconf.dictconfig.DictConfig", "omegaconf.listconfig.ListConfig"}:
        from omegaconf import OmegaConf  # (installed: the value is one of its objects)
        return {"t": "omegaconf", "v": encode(OmegaConf.to_container(v, resolve=True),
                                              depth + 1)}
    if _library_config(v):
        return {"t": "hf_config", "class": _import_path(type(v)),
                "v": encode(v.to_dict(), depth + 1)}
    if isinstance(v, functools.partial):
        return {"t": "partial", "func": encode(v.func, depth + 1),
                "args": [encode(x, depth + 1) for x in v.args],
                "keywords": {k: encode(x, depth + 1) for k, x in v.keywords.items()}}
    if isinstance(v, type) or inspect.isroutine(v):
        return {"t": "import", "import": _import_path(v)}
    raise Unstorable(f"a {type(v).__module__}.{type(v).__qualname__}")


def _import_path(obj) -> str:
    described = describe_callable(obj)
    if "import" not in described:
        raise Unstorable(f"{described['name']} ({described.get('why', 'not importable')})")
    return described["import"]
