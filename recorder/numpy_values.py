"""NumPy values in a batch, recorded as data rather than a ``repr`` the replay cannot rebuild: a
bool, integer or floating scalar (a task id from ``rng.integers``, which is no Python ``int``)
as ``{"$numpy": dtype name, "value": its value}``; an array of those kinds (a hand collate's
``np.array`` of record ids, offsets or a mask the model turns into a tensor itself) as a tensor
copy of it under ``{"$ndarray": {"$t": key}}``, rebuilt as an array again. NumPy is never
imported here: a run that made one has it."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

import torch

from .objects import UnrebuildableLeaf

_KINDS = ("b", "i", "u", "f")


def numpy_node(o: Any, path: str, put: Callable[[torch.Tensor, str], dict]) -> dict | None:
    """The bundle's node for the NumPy scalar or array ``o`` (``put``: stores a tensor leaf
    under ``path``); None for anything else, a string or object array among them."""
    if type(o).__module__ != "numpy" or getattr(getattr(o, "dtype", None), "kind", None) \
            not in _KINDS:
        return None
    if getattr(o, "shape", None) == ():
        v = o.item()
        if isinstance(v, float) and not math.isfinite(v):
            v = {"$float": repr(v)}
        return {"$numpy": o.dtype.name, "value": v}
    if type(o).__name__ != "ndarray":
        return None
    try:  # (a copy: a read-only array, a memory map, or one the loop writes into later)
        t = torch.from_numpy(sys.modules["numpy"].array(o, order="C", copy=True))
    except (TypeError, ValueError, KeyError):  # (a byte order or dtype torch does not take)
        return None
    return {"$ndarray": put(t, path)}


def numpy_rebuilt(node: dict[str, Any], inner: Callable[[Any], Any]) -> Any:
    """The scalar or array ``node`` recorded (``inner``: rebuilds an array's tensor node)."""
    if "$ndarray" in node:
        t = inner(node["$ndarray"])
        if not isinstance(t, torch.Tensor):
            raise UnrebuildableLeaf(f"numpy array {str(node['$ndarray'])[:40]}")
        return t.detach().cpu().numpy()
    try:
        import numpy
        dtype = numpy.dtype(node["$numpy"])
        if dtype.kind not in _KINDS:
            raise TypeError(dtype.kind)
        v = node.get("value")
        return dtype.type(float(v["$float"]) if isinstance(v, dict) else v)
    except (ImportError, TypeError, ValueError, KeyError) as e:
        raise UnrebuildableLeaf(f"numpy {str(node.get('$numpy'))[:20]} ({e})") from None
