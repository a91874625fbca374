"""Parameters a model reads through an object other than its modules: Keras 3's variables under
the PyTorch backend hold the torch ``Parameter`` as ``Variable._value`` and a layer's ``call``
reads ``self.kernel.value``, not the module's ``_torch_params`` entry. The replay assigns the
bundle's tensors as new parameters (``replay.weights.load_weights``), so such a holder would go
on giving the factory's freshly initialised weights to every re-run. Its attribute is pointed
at the bundle's parameter too."""

from __future__ import annotations

import types

import torch
from torch import nn

# how many objects reachable from the model are looked at, at most
BUDGET = 200_000

# values never walked into: they hold no parameter of the model's as an attribute
_LEAVES = (torch.Tensor, str, bytes, int, float, complex, bool, type, types.ModuleType,
           types.FunctionType, types.BuiltinFunctionType, types.MethodType, torch.dtype,
           torch.device)


def rebind_holders(model: nn.Module, replaced: dict[int, tuple[nn.Parameter, nn.Parameter]]
                   ) -> int:
    """Point every plain object's attribute, among the objects reachable from ``model``
    through attributes and containers, that still holds a replaced parameter (``old``) at its
    replacement (``new``); ``replaced`` maps ``id(old)`` to ``(old, new)``. A module's own
    attributes are left alone (its ``_parameters`` were assigned by name), but modules it
    keeps outside ``_modules`` are walked (Keras's functional layers, in a list). Returns how
    many attributes were pointed anew."""
    if not replaced:
        return 0
    seen: set[int] = set()
    stack: list = [model]
    count = budget = 0
    while stack and budget < BUDGET:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        budget += 1
        if isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(x for x in obj if not isinstance(x, _LEAVES) and x is not None)
            continue
        if isinstance(obj, dict):
            stack.extend(x for x in obj.values() if not isinstance(x, _LEAVES) and x is not None)
            continue
        own = getattr(obj, "__dict__", None)
        if not isinstance(own, dict):
            continue
        if not isinstance(obj, nn.Module):
            count += _rebind(own, replaced)
        stack.extend(x for x in own.values() if not isinstance(x, _LEAVES) and x is not None)
    return count


def _rebind(own: dict, replaced: dict[int, tuple[nn.Parameter, nn.Parameter]]) -> int:
    count = 0
    for key, value in list(own.items()):
        hit = replaced.get(id(value)) if isinstance(value, torch.Tensor) else None
        if hit is not None and hit[0] is value:
            own[key] = hit[1]
            count += 1
    return count
