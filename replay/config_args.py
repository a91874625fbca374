"""A model recorded without a factory rebuilt from the constructor arguments it kept as data
(``recorder.config_args``: nanoGPT's ``GPT(config)``, a Namespace, an OmegaConf or Hugging Face
config, timm's ``norm_layer=partial(nn.LayerNorm, eps=1e-6)``): the model's class imported under
the factory's trust rule and called with them, so the run's values (``n_layer``, an ``eps`` of
0) are the rebuilt model's, not the class's defaults.

Nothing is unpickled and no recorded name is called but a type that rebuilds data: a dataclass
of the user's own code (its generated ``__init__``), an enum's member lookup, a
``PretrainedConfig``'s ``from_dict``, OmegaConf's ``create``; a recorded class or function given
as an argument (the model calls it) is handed to the model's constructor only when it is the
user's own code or torch.nn's (``nn.GELU``, ``partial(nn.LayerNorm, eps=1e-6)``): a bundle
cannot make the model call an installed package's function with arguments of its choosing.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import functools
import types
from pathlib import Path
from typing import Any

import torch

from recorder.config_args import HF_CONFIGS
from recorder.validate import import_object

from .errors import ReplayError
from .trust import defined_in, installed_roots, module_origin, own_code, trusted_path


def init_factory(init: dict[str, Any], model_class, trusted: bool = False):
    """The function building the model: ``model_class(**args)``, the arguments decoded as it
    is called (so a build on the meta device makes them again). ``trusted``: the user named
    the class (``--factory``), so the config types of its package are imported too."""
    args = init.get("args") or {}
    roots = [Path.cwd(), *installed_roots()]
    if trusted and (home := module_origin(model_class.__module__.split(".")[0])):
        roots.append(Path(home) if Path(home).is_dir() else Path(home).parent)
    return lambda: model_class(**{k: decode(v, roots) for k, v in args.items()})


def missing_note(init: dict[str, Any] | None) -> str:
    """What the recorder could not keep of the constructor's arguments, for the advice."""
    missing = (init or {}).get("missing")
    if not missing:
        return ""
    return (f"its class {init.get('class')} takes {', '.join(map(str, missing))}, so the "
            "bundle cannot rebuild it from its data; ")


def decode(v: Any, roots: list[Path]) -> Any:
    if not isinstance(v, dict):
        return v
    kind = v.get("t")
    if kind in ("list", "tuple"):
        items = [decode(x, roots) for x in v["items"]]
        return items if kind == "list" else tuple(items)
    if kind == "dict":
        return {decode(k, roots): decode(x, roots) for k, x in v["items"]}
    if kind == "float":
        return float(v["v"])
    if kind == "dtype":
        dtype = getattr(torch, str(v["name"]), None)
        if not isinstance(dtype, torch.dtype):
            raise ReplayError(f"the recorded dtype {v['name']!r} is not one of this torch's")
        return dtype
    if kind == "device":
        return torch.device(v["v"])
    if kind == "path":
        return Path(v["v"])
    if kind == "namespace":
        made = argparse.Namespace if v.get("kind") == "argparse" else types.SimpleNamespace
        return made(**decode(v["items"], roots))
    return _decode_typed(kind, v, roots)


def _decode_typed(kind: str | None, v: dict[str, Any], roots: list[Path]) -> Any:
    if kind == "dataclass":
        cls = _trusted(v["class"], "dataclass", roots)
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            raise ReplayError(f"the recorded config class {v['class']} is no dataclass now")
        if not own_code(cls, roots):  # (its __post_init__ runs on the bundle's values)
            raise ReplayError(f"the recorded config class {v['class']} is not the run's own "
                              "code, so nanreplay does not build it from the bundle's values; "
                              "pass --factory MOD:FN, a function returning the model")
        return cls(**{k: decode(x, roots) for k, x in v["fields"].items()})
    if kind == "enum":
        cls = _trusted(v["class"], "enum", roots)
        if not (isinstance(cls, type) and issubclass(cls, enum.Enum)):
            raise ReplayError(f"the recorded enum class {v['class']} is no Enum now")
        return cls[v["name"]]
    if kind == "omegaconf":
        from omegaconf import OmegaConf
        return OmegaConf.create(decode(v["v"], roots))
    if kind == "hf_config":
        cls = _trusted(v["class"], "config class", roots)
        if not any(f"{c.__module__}.{c.__qualname__}" in HF_CONFIGS
                   for c in getattr(cls, "__mro__", ())):
            raise ReplayError(f"the recorded config class {v['class']} is no PretrainedConfig")
        return cls.from_dict(decode(v["v"], roots))
    if kind == "partial":
        return functools.partial(_callable(v["func"], roots),
                                 *[decode(x, roots) for x in v["args"]],
                                 **{k: decode(x, roots) for k, x in v["keywords"].items()})
    if kind == "import":
        return _callable(v, roots)
    raise ReplayError(f"a recorded constructor argument is of a kind this nanreplay does not "
                      f"know ({kind!r}); update nanreplay or pass --factory MOD:FN")


def _callable(v: Any, roots: list[Path]):
    """A recorded class or function handed to the model's constructor (``act_layer``, the
    function of a ``partial``): the model calls it, with arguments the bundle may choose (a
    partial's), so a bundle must not pick it among every installed package's functions. Taken:
    the user's own code (under the current directory, or the model's package when named with
    --factory), and torch.nn's layers and functions (``nn.GELU``, ``F.gelu``)."""
    if not (isinstance(v, dict) and v.get("t") == "import"):
        raise ReplayError("a recorded partial's function is not a class or function by its "
                          "import path; pass --factory MOD:FN")
    obj = _trusted(v["import"], "callable", roots)
    own = own_code(obj, roots)
    torch_nn = isinstance(obj, type) and issubclass(obj, torch.nn.Module) \
        and obj.__module__.startswith("torch.nn.") \
        or getattr(obj, "__module__", None) == "torch.nn.functional"
    if not (own or torch_nn):
        raise ReplayError(f"the recorded callable {v['import']} is neither the run's own code "
                          "nor a torch.nn layer or function, so nanreplay does not hand it to "
                          "the model (a bundle must not choose code to run); pass --factory "
                          "MOD:FN, a function returning the model as the run built it")
    return obj


def _trusted(spec: str, what: str, roots: list[Path]):
    """``module:qualname`` imported when it lives under the current directory or in an
    installed package, and the object found is defined there too."""
    mod, _, attr = str(spec).partition(":")
    if not mod or not attr or not trusted_path(module_origin(mod), roots):
        raise ReplayError(f"the recorded {what} {spec} is neither under the current directory "
                          f"({Path.cwd()}) nor in an installed package, so nanreplay does not "
                          "import it; run from the directory the run ran in")
    try:
        obj = import_object(mod, attr)
    except Exception as e:
        raise ReplayError(f"the recorded {what} {spec} cannot be imported ({type(e).__name__}: "
                          f"{e})") from None
    if not trusted_path(defined_in(obj) or module_origin(mod), roots):
        raise ReplayError(f"the recorded {what} {spec} leads outside the current directory and "
                          "installed packages; nanreplay does not import it")
    return obj
