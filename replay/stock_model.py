"""The model of a bundle recorded without a factory whose modules are all PyTorch's own
(``recorder.stock_model``: an ``nn.Sequential`` of ``nn.Linear`` and ``nn.ReLU`` made in a
notebook), rebuilt from the bundle's description: each class imported from ``torch.nn`` alone,
called with its recorded attributes that its constructor takes (``in_features``,
``kernel_size``, ``normalized_shape``), the others set as recorded, its children rebuilt the
same way, and the parameters the bundle does not hold left out (``bias=False``). The weights
are then the bundle's (``replay.load``). A description that names any other class, or that a
constructor refuses, rebuilds nothing."""

from __future__ import annotations

import importlib
import inspect
from functools import partial
from typing import Any

from torch import nn

from recorder.stock_model import STOCK


class NotStock(Exception):
    """The description names a class outside ``torch.nn.modules`` or is malformed."""


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
    return _module(tree, "", params, buffers)


def _module(node: Any, prefix: str, params: set[str], buffers: set[str]) -> nn.Module:
    if not isinstance(node, dict) or not isinstance(node.get("config", {}), dict) \
            or not isinstance(node.get("children", {}), dict):
        raise NotStock("a malformed module description")
    cls = _class(node.get("class"))
    tuples = set(node.get("tuples") or ())
    config = {k: tuple(v) if k in tuples and isinstance(v, list) else v
              for k, v in node.get("config", {}).items() if isinstance(k, str)}
    taken = set(inspect.signature(cls).parameters)
    m = cls(**{k: v for k, v in config.items() if k in taken})
    for k, v in config.items():
        if k not in taken and not k.startswith("_"):
            setattr(m, k, v)
    for k, child in node.get("children", {}).items():
        m.add_module(k, None if child is None else _module(child, f"{prefix}{k}.", params,
                                                            buffers))
    for k in [k for k, p in m.named_parameters(recurse=False) if f"{prefix}{k}" not in params]:
        m.register_parameter(k, None)  # (built by default, absent in the run: bias=False)
    for k in [k for k, b in m.named_buffers(recurse=False) if f"{prefix}{k}" not in buffers]:
        m.register_buffer(k, None)
    return m


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
