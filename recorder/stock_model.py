"""A model made of PyTorch's own modules only (``nn.Sequential(nn.Linear(8, 16), nn.ReLU(),
...)``, built in a script or a notebook cell): described in the bundle by each module's class
and plain attributes, so the replay rebuilds it without a factory (``replay.stock_model``).
Written only where no factory was given and the model's class cannot be called bare; one user
class anywhere in the tree (its forward is the user's code) and nothing is written. Nothing is
pickled: the replay imports ``torch.nn``'s classes alone and calls them with these values.
A tensor the model reaches under two names (a head tied to the embedding) is listed under
``tied``, so the replay ties it again.

>>> describe_stock(nn.Sequential(nn.Linear(8, 16), nn.ReLU()))["children"]["0"]  # doctest: +SKIP
{'class': 'torch.nn.modules.linear:Linear', 'config': {'in_features': 8, ...}, ...}
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from .compat import own_slots
from .lossdesc import json_plain, to_json

STOCK = "torch.nn.modules."


def describe_stock(model: nn.Module) -> dict[str, Any] | None:
    """The tree of ``model``'s modules (class, plain attributes, children), or None when one of
    them is not a class of ``torch.nn.modules`` (a user's, a library's, a compile wrapper)."""
    if not all(type(m).__module__.startswith(STOCK) for m in model.modules()):
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


def _node(m: nn.Module) -> dict[str, Any]:
    cls = type(m)
    config = {k: v for k, v in vars(m).items()
              if not k.startswith("_") and k != "training" and json_plain(v)}
    children = own_slots(m)[3]
    node = {"class": f"{cls.__module__}:{cls.__qualname__}",
            "config": {k: to_json(v) for k, v in config.items()},
            "tuples": sorted(k for k, v in config.items() if isinstance(v, tuple)),
            "children": {k: None if c is None else _node(c) for k, c in children.items()}}
    # (nn.Unflatten(1, x.shape[1:]) keeps a torch.Size, its repr not a tuple's; the bundle
    # spells a float inf as the string 'inf': both read back as they were)
    if sizes := sorted(k for k, v in config.items() if isinstance(v, torch.Size)):
        node["sizes"] = sizes
    if floats := sorted(k for k, v in config.items()
                        if isinstance(v, float) and not math.isfinite(v)):
        node["floats"] = floats
    return node
