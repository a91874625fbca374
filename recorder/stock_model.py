"""A model made of PyTorch's own modules only (``nn.Sequential(nn.Linear(8, 16), nn.ReLU(),
...)``, built in a script or a notebook cell): described in the bundle by each module's class
and plain attributes, so the replay rebuilds it without a factory (``replay.stock_model``).
Written only where no factory was given and the model's class cannot be called bare; one user
class anywhere in the tree (its forward is the user's code) and nothing is written. Nothing is
pickled: the replay imports ``torch.nn``'s classes alone and calls them with these values.

>>> describe_stock(nn.Sequential(nn.Linear(8, 16), nn.ReLU()))["children"]["0"]  # doctest: +SKIP
{'class': 'torch.nn.modules.linear:Linear', 'config': {'in_features': 8, ...}, ...}
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .compat import own_slots
from .lossdesc import json_plain, to_json

STOCK = "torch.nn.modules."


def describe_stock(model: nn.Module) -> dict[str, Any] | None:
    """The tree of ``model``'s modules (class, plain attributes, children), or None when one of
    them is not a class of ``torch.nn.modules`` (a user's, a library's, a compile wrapper)."""
    if not all(type(m).__module__.startswith(STOCK) for m in model.modules()):
        return None
    return _node(model)


def _node(m: nn.Module) -> dict[str, Any]:
    cls = type(m)
    config = {k: v for k, v in vars(m).items()
              if not k.startswith("_") and k != "training" and json_plain(v)}
    children = own_slots(m)[3]
    return {"class": f"{cls.__module__}:{cls.__qualname__}",
            "config": {k: to_json(v) for k, v in config.items()},
            "tuples": sorted(k for k, v in config.items() if isinstance(v, tuple)),
            "children": {k: None if c is None else _node(c) for k, c in children.items()}}
