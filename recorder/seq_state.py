"""Optimizer state held as a tuple or list of tensors: a low-bit optimizer written by hand keeps
each moment quantised, as its codes and their block scales (torchao's ``OptimStateFp8``,
bitsandbytes' blockwise states: ``state["exp_avg"] = (codes, absmax)``). Neither a tensor nor
JSON, such a value was left out of the bundle, and the replay's update then ran on a state
missing it (a ``KeyError`` in the optimizer's own ``step``). Its tensors are stored under
``optim_seq/<param>/<key>/<i>`` (not ``optim/``, whose keys are the state's own), and the
state scalars say how to put the sequence back together. Written only at an event."""

from __future__ import annotations

from typing import Any

import torch

SEQ = "$seq"
PREFIX = "optim_seq/"


def is_seq(v: Any) -> bool:
    """``v`` is a tuple or list of tensors (and Nones)."""
    return isinstance(v, (tuple, list)) and any(isinstance(x, torch.Tensor) for x in v) \
        and all(x is None or isinstance(x, torch.Tensor) for x in v)


def store_seq(name: str, key: str, v: Any, tensors: dict[str, torch.Tensor],
              scalars: dict[str, dict[str, Any]], prefix: str = PREFIX) -> bool:
    """Store ``v`` when it is a tuple or list of tensors (and Nones): its tensors into
    ``tensors`` (under ``prefix``: a rewind window's copy has its own), its layout into
    ``scalars[name][key]``. False for any other value."""
    if not is_seq(v):
        return False
    items: list[str | None] = []
    for i, x in enumerate(v):
        items.append(None if x is None else f"{prefix}{name}/{key}/{i}")
        if x is not None:
            tensors[items[-1]] = x.detach()
    scalars.setdefault(name, {})[key] = {SEQ: type(v).__name__, "items": items}
    return True


def load_seq(v: Any, tensors: dict[str, torch.Tensor], device, copy: bool = False) -> Any:
    """A state scalar back as its tuple or list of tensors (on ``device``; copies with
    ``copy``, which an update may write in place) when :func:`store_seq` wrote it; any other
    value unchanged."""
    if not isinstance(v, dict) or SEQ not in v:
        return v
    items = [None if k is None else tensors[k].to(device, copy=copy) for k in v["items"]]
    return items if v[SEQ] == "list" else tuple(items)


def cloned(v: Any) -> Any:
    """``v`` copied for the guard's state before the update: a tensor, or a tuple or list of
    them (whose tensors an optimizer may write in place), else as it is."""
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    if isinstance(v, (tuple, list)) and any(isinstance(x, torch.Tensor) for x in v):
        return type(v)(x.detach().clone() if isinstance(x, torch.Tensor) else x for x in v)
    return v
