"""A value computed from a tensor, remembered while that tensor lives unmodified.

A module's output is often the next call's input, or passed on by its parent: one run reduces
it once. The memo is keyed by identity and checked against a weak reference (an id is reused
once its tensor is freed) and the version counter (an in-place write makes a new value). An
inference-mode tensor keeps no version counter: its value is not remembered.
"""

from __future__ import annotations

import weakref
from functools import partial
from typing import Any

import torch

from .compat import version_of


class TensorMemo:
    """``memo.get(t)`` is what ``memo.put(t, value)`` stored, None once ``t`` was freed or
    written in place since."""

    def __init__(self):
        self._seen: dict[int, tuple[weakref.ref, int, Any]] = {}

    def get(self, t: torch.Tensor) -> Any:
        hit = self._seen.get(id(t))
        if hit is not None and hit[0]() is t and hit[1] == version_of(t):
            return hit[2]
        return None

    def put(self, t: torch.Tensor, value: Any) -> Any:
        v = version_of(t)
        if v is not None:
            self._seen[id(t)] = (weakref.ref(t, partial(self._drop, id(t))), v, value)
        return value

    def _drop(self, key: int, ref: weakref.ref) -> None:
        """``ref``'s tensor was freed: let its value go (a tensor-sized one: a difference's
        terms, replay.cancellation) rather than hold it until the id is reused."""
        hit = self._seen.get(key)
        if hit is not None and hit[0] is ref:
            del self._seen[key]


class TensorSet:
    """Tensors by identity, held weakly: whether ``t`` itself was added (an id is reused once
    its tensor is freed)."""

    def __init__(self):
        self._refs: dict[int, weakref.ref] = {}

    def add(self, t: torch.Tensor) -> None:
        self._refs[id(t)] = weakref.ref(t)

    def __contains__(self, t: torch.Tensor) -> bool:
        ref = self._refs.get(id(t))
        return ref is not None and ref() is t


class TensorMarks:
    """A mark per tensor while it lives, by identity (checked by a weak reference); unlike
    :class:`TensorMemo` not cleared by an in-place write: the dispatch mode that marks says
    itself what such a write kept (``put`` again, or ``drop``)."""

    def __init__(self):
        self._of: dict[int, tuple[weakref.ref, Any]] = {}

    def get(self, t) -> Any:
        hit = self._of.get(id(t))
        return hit[1] if hit is not None and hit[0]() is t else None

    def put(self, t: torch.Tensor, mark: Any) -> None:
        self._of[id(t)] = (weakref.ref(t), mark)

    def drop(self, t: torch.Tensor) -> None:
        self._of.pop(id(t), None)
