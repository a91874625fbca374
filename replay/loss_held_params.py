"""A loss the factory returns that holds the model's parameters itself: a weight decay over a
list of them, ``functools.partial(loss, params=[p for n, p in model.named_parameters() if
...])``, or a closure over such a list. The replay builds the model on the meta device and
assigns the bundle's tensors as new parameters (``replay.weights.load_weights``), so that list
would go on holding the factory's placeholders: the re-run loss raised 'Tensor.item() cannot be
called on meta tensors' (or read the factory's fresh weights). Its entries are pointed at the
loaded parameters, wherever the loss holds them: a partial's arguments, a closure's cells, a
bound method's object, an object's attributes, and lists and dicts inside those."""

from __future__ import annotations

import functools
import types
from typing import Any

import torch
from torch import nn

BUDGET = 10_000  # objects looked at, at most
_EMPTY = object()

_SKIP = (str, bytes, int, float, complex, bool, type, types.ModuleType, torch.dtype,
         torch.device, types.BuiltinFunctionType)


def rebind_loss_params(loss_fn: Any, old: dict[str, torch.Tensor], model: nn.Module) -> int:
    """Point the parameters ``loss_fn`` holds from the factory's model (``old``, by name) at
    the model's parameters of those names now; returns how many entries were pointed anew."""
    new = dict(model.named_parameters(remove_duplicate=False))
    swap = {id(p): new[n] for n, p in old.items() if n in new and new[n] is not p}
    if not swap or loss_fn is None:
        return 0
    seen: set[int] = set()
    stack, count = [loss_fn], 0
    while stack and len(seen) < BUDGET:
        obj = stack.pop()
        if isinstance(obj, (torch.Tensor, *_SKIP)) or obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, list):
            count += _swap_items(obj, range(len(obj)), swap)
            stack.extend(obj)
        elif isinstance(obj, dict):
            count += _swap_items(obj, list(obj), swap)
            stack.extend(obj.values())
        elif isinstance(obj, (tuple, set, frozenset)):
            stack.extend(obj)
        else:
            stack.extend(_parts(obj, swap))
            if not isinstance(obj, nn.Module) and isinstance(vars_of(obj), dict):
                count += _swap_items(vars_of(obj), list(vars_of(obj)), swap)
    return count


def vars_of(obj: Any) -> dict | None:
    own = getattr(obj, "__dict__", None)
    return own if isinstance(own, dict) else None


def _swap_items(box, keys, swap: dict[int, torch.Tensor]) -> int:
    count = 0
    for k in keys:
        v = box[k]
        if isinstance(v, torch.Tensor) and id(v) in swap:
            box[k] = swap[id(v)]
            count += 1
    return count


def _parts(obj: Any, swap: dict[int, torch.Tensor]) -> list:
    """What a callable holds: a partial's function and arguments, a function's closure cells
    (a cell holding a parameter is pointed anew here) and defaults, a method's object."""
    if isinstance(obj, functools.partial):
        return [obj.func, obj.args, obj.keywords]
    if isinstance(obj, types.MethodType):
        return [obj.__func__, obj.__self__]
    if isinstance(obj, types.FunctionType):
        held = [_contents(c) for c in obj.__closure__ or ()]
        for cell, v in zip(obj.__closure__ or (), held):
            if isinstance(v, torch.Tensor) and id(v) in swap:
                cell.cell_contents = swap[id(v)]
        return [v for v in held if v is not _EMPTY] + [obj.__defaults__, obj.__kwdefaults__]
    own = vars_of(obj)
    return list(own.values()) if own is not None and not isinstance(obj, nn.Module) else []


def _contents(cell) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # (an empty cell)
        return _EMPTY
