"""Wrapper tensor subclasses (``_make_wrapper_subclass`` with their own ``__torch_dispatch__``:
QLoRA's int8/NF4 base weights, torchao's quantized tensors) made storable.

Such a tensor has no storage of its own (``data_ptr()`` is 0): its values live in the inner
tensors ``__tensor_flatten__`` names (int8 data, a per-row scale). The bundle holds those under
``wrapped/<key>/<attr>`` (what the replay loads into the factory's own subclass parameter, so
that the re-run computes as the run did) and, under ``<key>`` itself, the dense value the
subclass's dispatch computes (what the replay's readings see). The class's import name and
its flatten context (when JSON-able) go in ``meta["wrapped"][<key>]``; nothing is pickled.
"""

from __future__ import annotations

import json
from typing import Any

import torch

__all__ = ["is_wrapper", "store_wrapped"]

_PLAIN = torch.Tensor.__torch_dispatch__
PREFIX = "wrapped/"


def is_wrapper(t: Any) -> bool:
    """``t`` is a tensor whose class dispatches itself (not a plain tensor or nn.Parameter)."""
    return isinstance(t, torch.Tensor) and \
        getattr(type(t), "__torch_dispatch__", _PLAIN) is not _PLAIN


def _dense(t: torch.Tensor) -> torch.Tensor | None:
    """``t``'s value as a plain tensor, as its own dispatch computes it (a clone dequantizes);
    None when the subclass answers only with itself."""
    with torch.no_grad():
        for make in (lambda: t.clone(), lambda: t.dequantize(), lambda: t.to_dense()):
            try:
                d = make()
            except Exception:  # (a subclass refusing the op: try the next way)
                continue
            if isinstance(d, torch.Tensor) and not is_wrapper(d) and d.shape == t.shape:
                return d.detach()
    return None


def _context(ctx: Any) -> Any:
    try:
        json.dumps(ctx, allow_nan=False)
    except (TypeError, ValueError):
        return None
    return ctx


def _flatten(key: str, t: torch.Tensor, out: dict[str, torch.Tensor]) -> dict[str, Any]:
    """``t``'s inner tensors into ``out`` (nested wrappers flattened in turn) and its entry."""
    if not hasattr(t, "__tensor_flatten__"):
        raise TypeError(f"bundle entry {key!r} is a {type(t).__qualname__} tensor subclass with "
                        "its own __torch_dispatch__ but no __tensor_flatten__: the recorder "
                        "cannot read its values; give the class __tensor_flatten__ (as torchao's "
                        "subclasses have) or record the model with plain tensors")
    attrs, ctx = t.__tensor_flatten__()
    cls = type(t)
    entry: dict[str, Any] = {"class": f"{cls.__module__}.{cls.__qualname__}",
                             "inner": list(attrs), "context": _context(ctx)}
    nested = {}
    for a in attrs:
        inner = getattr(t, a)
        if is_wrapper(inner):
            nested[a] = _flatten(f"{key}/{a}", inner, out)
        else:
            out[f"{PREFIX}{key}/{a}"] = inner.detach()
    if nested:
        entry["nested"] = nested
    return entry


def store_wrapped(meta: dict[str, Any], tensors: dict[str, torch.Tensor]
                  ) -> dict[str, torch.Tensor]:
    """Every wrapper subclass among ``tensors`` replaced by its dense value (dropped when it
    has none) and its inner tensors added beside it, described in ``meta["wrapped"]``;
    returns ``tensors``."""
    described: dict[str, Any] = {}
    for key, t in list(tensors.items()):
        if not is_wrapper(t):
            continue
        described[key] = _flatten(key, t, tensors)
        dense = _dense(t)
        if dense is None:
            del tensors[key]
            described[key]["no_dense"] = True
        else:
            tensors[key] = dense
    if described:
        meta["wrapped"] = described
    return tensors
