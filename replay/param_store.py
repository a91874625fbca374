"""A library's global store of parameters by name, which would hand the factory's parameters
back to the model after the bundle's replaced them.

Pyro keeps every ``PyroModule`` parameter (``PyroParam``, an ``AutoNormal`` guide's locs and
scales) and every parameter ``pyro.module`` registers in one process-wide ``ParamStore``, and a
``PyroModule`` takes the store's tensor over its own at each access when the two differ (the
store is the reference, so that ``pyro.get_param_store().load`` restores a model). The factory,
which builds the model and runs its guide once so its lazy parameters exist, fills that store
with its own parameters; :func:`replay.weights.load_weights` then assigns the bundle's as the
model's, and the re-run's first access would put the factory's back: the step re-run on the
factory's initial weights, finite, read as ``not_reproduced``. :func:`forget_replaced` drops the
store's entries that hold a parameter the bundle replaced, so the modules register their own
(the bundle's) again at their next access. Nothing is imported: a model without Pyro has no
store to look at.
"""

from __future__ import annotations

import sys

import torch


def forget_replaced(replaced: set[int]) -> list[str]:
    """Delete from Pyro's parameter store (when Pyro is loaded) each entry whose tensor is one
    of the parameters ``replaced`` (their ids); the names dropped."""
    pyro = sys.modules.get("pyro")
    store = getattr(pyro, "get_param_store", None) if pyro is not None else None
    if store is None or not replaced:
        return []
    store = store()
    stale = [name for name, t in list(store.named_parameters())
             if isinstance(t, torch.Tensor) and id(t) in replaced]
    for name in stale:
        del store[name]
    return stale
