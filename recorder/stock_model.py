"""A model made of PyTorch's own modules only (``nn.Sequential(nn.Linear(8, 16), nn.ReLU(),
...)``, built in a script or a notebook cell): described in the bundle by each module's class
and plain attributes, so the replay rebuilds it without a factory (``replay.stock_model``).
Written only where no factory was given and the model's class cannot be called bare; one user
class anywhere in the tree (its forward is the user's code) and nothing is written. Nothing is
pickled: the replay imports ``torch.nn``'s classes alone and calls them with these values.
A tensor the model reaches under two names (a head tied to the embedding) is listed under
``tied``, so the replay ties it again. torch's own weight reparametrizations on a module
(``parametrizations.weight_norm``, ``spectral_norm``, ``orthogonal``; the hook-based
``nn.utils.weight_norm`` and ``spectral_norm``) are listed under ``applied`` by the public
function that applies each and its arguments, so the replay applies them again: the module is
described by its own class (``Linear``, not torch's generated ``ParametrizedLinear``). A
parametrization of the user's own (``register_parametrization(m, "weight", Symmetric())``) is
user code: nothing is written.

>>> describe_stock(nn.Sequential(nn.Linear(8, 16), nn.ReLU()))["children"]["0"]  # doctest: +SKIP
{'class': 'torch.nn.modules.linear:Linear', 'config': {'in_features': 8, ...}, ...}
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from .compat import forward_hooks, own_slots
from .lossdesc import json_plain, to_json

STOCK = "torch.nn.modules."
PARAMETRIZED = "torch.nn.utils.parametrize"  # (where torch makes ParametrizedLinear)
# torch's own reparametrizations by class: the name the replay applies each by, and the
# attributes that are its arguments (replay.stock_model.APPLY)
_APPLIED = {
    "torch.nn.utils.parametrizations:_WeightNorm": ("weight_norm", ("dim",)),
    "torch.nn.utils.parametrizations:_SpectralNorm": (
        "spectral_norm", ("n_power_iterations", "eps", "dim")),
    "torch.nn.utils.parametrizations:_Orthogonal": ("orthogonal", ()),
    "torch.nn.utils.weight_norm:WeightNorm": ("hooked_weight_norm", ("dim",)),
    "torch.nn.utils.spectral_norm:SpectralNorm": (
        "hooked_spectral_norm", ("n_power_iterations", "eps", "dim")),
}


def describe_stock(model: nn.Module) -> dict[str, Any] | None:
    """The tree of ``model``'s modules (class, plain attributes, children), or None when one of
    them is not a class of ``torch.nn.modules`` (a user's, a library's, a compile wrapper), or
    carries a parametrization that is not torch's own."""
    if _base(model) is None or any(_base(m) is None for m in _stock_modules(model)):
        return None
    if any(_applied(m) is None for m in _stock_modules(model)):
        return None
    tree = _node(model)
    if tied := _tied(model):
        tree["tied"] = tied
    return tree


def _tied(model: nn.Module) -> dict[str, str]:
    """Each parameter or buffer reached under a second name, by the first (``head.weight =
    emb.weight``; a module used twice, ``nn.Sequential(lin, act, lin)``): the bundle holds it
    under the first name alone."""
    first: dict[int, str] = {}
    tied = {}
    for name, t in [*model.named_parameters(remove_duplicate=False),
                    *model.named_buffers(remove_duplicate=False)]:
        if (src := first.setdefault(id(t), name)) != name:
            tied[name] = src
    return tied


def _base(m: nn.Module) -> type | None:
    """``m``'s class when torch.nn's, the class torch's ``Parametrized...`` subclass was made
    from, else None."""
    cls = type(m)
    if cls.__module__ == PARAMETRIZED and cls.__name__.startswith("Parametrized") \
            and len(cls.__bases__) == 1:
        cls = cls.__bases__[0]
    return cls if cls.__module__.startswith(STOCK) else None


def _children(m: nn.Module) -> dict[str, Any]:
    """``m``'s children, less the ``parametrizations`` torch added (described as ``applied``)."""
    children = own_slots(m)[3]
    return {k: c for k, c in children.items()
            if not (k == "parametrizations" and type(m) is not _base(m))}


def _stock_modules(m: nn.Module):
    yield m
    for c in _children(m).values():
        if c is not None:
            yield from _stock_modules(c)


def _applied(m: nn.Module) -> list[dict[str, Any]] | None:
    """torch's reparametrizations on ``m``, in the order applied (the hook-based ones first:
    a pre-hook, whatever was registered after it); None when one is the user's own."""
    said = [_said(h, h.name) for kind, h in forward_hooks(m)
            if kind == "forward_pre" and _key(h) in _APPLIED]
    if type(m) is not _base(m):
        for tensor, chain in m.parametrizations.items():
            said += [_said(p, tensor) for p in chain]
    return None if any(d is None for d in said) else said


def _key(obj: Any) -> str:
    return f"{type(obj).__module__}:{type(obj).__qualname__}"


def _said(p: Any, tensor: str) -> dict[str, Any] | None:
    if (known := _APPLIED.get(_key(p))) is None:
        return None
    name, attrs = known
    args = {a: getattr(p, a) for a in attrs}
    if name == "orthogonal":  # (an enum; a buffer ``base`` only with the trivialization)
        args = {"orthogonal_map": p.orthogonal_map.name,
                "use_trivialization": "base" in own_slots(p)[1]}
    if not all(json_plain(v) for v in args.values()):
        return None
    return {"apply": name, "tensor": tensor, "args": {k: to_json(v) for k, v in args.items()}}


def _node(m: nn.Module) -> dict[str, Any]:
    cls = _base(m)
    config = {k: v for k, v in vars(m).items()
              if not k.startswith("_") and k != "training" and json_plain(v)}
    children = _children(m)
    node = {"class": f"{cls.__module__}:{cls.__qualname__}",
            "config": {k: to_json(v) for k, v in config.items()},
            "tuples": sorted(k for k, v in config.items() if isinstance(v, tuple)),
            "children": {k: None if c is None else _node(c) for k, c in children.items()}}
    if applied := _applied(m):
        node["applied"] = applied
    # (nn.Unflatten(1, x.shape[1:]) keeps a torch.Size, its repr not a tuple's; the bundle
    # spells a float inf as the string 'inf': both read back as they were)
    if sizes := sorted(k for k, v in config.items() if isinstance(v, torch.Size)):
        node["sizes"] = sizes
    if floats := sorted(k for k, v in config.items()
                        if isinstance(v, float) and not math.isfinite(v)):
        node["floats"] = floats
    return node
