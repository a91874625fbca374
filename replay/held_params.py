"""Parameters a model reads through an object other than its modules: Keras 3's variables under
the PyTorch backend hold the torch ``Parameter`` as ``Variable._value`` and a layer's ``call``
reads ``self.kernel.value``, not the module's ``_torch_params`` entry. The replay assigns the
bundle's tensors as new parameters (``replay.weights.load_weights``), so such a holder would go
on giving the factory's freshly initialised weights to every re-run. Its attribute is pointed
at the bundle's parameter too."""

from __future__ import annotations

import gc

from torch import nn


def rebind_holders(replaced: dict[int, tuple[nn.Parameter, nn.Parameter]]) -> int:
    """Point every plain object's attribute that still holds a replaced parameter (``old``) at
    its replacement (``new``); ``replaced`` maps ``id(old)`` to ``(old, new)``. Modules are
    left alone (their ``_parameters`` were assigned by name). One pass over the heap for all
    of them; returns how many attributes were pointed anew."""
    if not replaced:
        return 0
    olds = [old for old, _ in replaced.values()]
    found = gc.get_referrers(*olds)
    # (an object whose __dict__ is not materialised refers to its values itself: 3.11+)
    spaces = {id(o.__dict__): o.__dict__ for o in found if _plain_owner(o)}
    dicts = [d for d in found if isinstance(d, dict)]
    if dicts:
        for o in gc.get_referrers(*dicts):
            d = getattr(o, "__dict__", None) if _plain_owner(o) else None
            if isinstance(d, dict) and any(d is x for x in dicts):
                spaces[id(d)] = d
    count = 0
    for d in spaces.values():
        for key, value in list(d.items()):
            hit = replaced.get(id(value))
            if hit is not None and hit[0] is value:
                d[key] = hit[1]
                count += 1
    return count


def _plain_owner(obj) -> bool:
    """An object whose ``__dict__`` may hold a parameter the model reads (no module, no
    class or module namespace)."""
    return hasattr(obj, "__dict__") and not isinstance(obj, (nn.Module, type)) \
        and type(obj).__name__ != "module"
