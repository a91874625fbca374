"""Root inputs that are a loss's targets: the values a model computing its own loss compares
(``labels=`` as a Hugging Face model takes them; nanoGPT's ``model(idx, targets)``, a plain
``model(x, y)`` passed positionally, matched to the forward's parameter names; the second of
an ``(inputs, targets)`` pair passed whole, ``model(batch)``; a batch dict's ``"y_true"``),
never a graph batch's assignment vector. A batch's class labels sorted by chance
(``[0, 1, 2, 2]``; all ``0`` in an imbalanced binary task) read as one (integers from 0, never
decreasing, below their count), and the batch's rows were named as graphs: a batch of 4 taken
as 3 samples, its fourth row named as the third."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import torch

from .objects import described

# the keyword (or batch key) names of a loss target: transformers' ``labels``, PyG's ``y``,
# nanoGPT's ``targets``, Keras-style ``y_true``, a segmentation's ground truth ``gt``
TARGET_NAMES = frozenset({"labels", "label", "targets", "target", "y", "y_true", "gt",
                          "ground_truth"})
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def named_target(path: tuple) -> bool:
    """A structure's ``path`` (its keys and indices from the root) ends in a target's name
    (``labels``, or one ending so: ``class_labels``, ``seg_target``)."""
    if not path or not isinstance(path[-1], str):
        return False
    name = path[-1].lower()
    return name in TARGET_NAMES or name.rsplit("_", 1)[-1] in TARGET_NAMES - {"y"}


def forward_names(model: Any) -> tuple[str, ...]:
    """The names of ``model.forward``'s positional parameters, in order; () when unknown (no
    model, a forward of ``*args`` only, one ``inspect`` cannot read). Read at an event only."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (AttributeError, TypeError, ValueError):
        return ()
    names = []
    for p in params:
        if p.kind not in _POSITIONAL:
            break
        names.append(p.name)
    return tuple(names)


def named_args(args: tuple, kwargs: dict, names: tuple[str, ...]) -> list:
    """A root call's arguments as ``[unnamed positional, {name: value}]``: each positional
    argument under its parameter's name where ``names`` (:func:`forward_names`) has one."""
    return [list(args[len(names):]), {**dict(zip(names, args)), **kwargs}]


def untargeted(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors in a nested structure of tuples, lists, dicts and batch objects (a root
    call's ``[args, kwargs]``, see :func:`named_args`) that are no loss target."""
    return (t for t, target in _walk(obj, None, 0, False) if not target)


def target_ids(obj: Any) -> frozenset[int]:
    """The ids of the tensors in ``obj`` (as :func:`untargeted` takes it) that are loss
    targets."""
    return frozenset(id(t) for t, target in _walk(obj, None, 0, False) if target)


def _walk(obj: Any, name: Any, depth: int, under: bool) -> Iterator[tuple[torch.Tensor, bool]]:
    """(tensor, is a target): held under a target's name, or in the second of a pair that is
    one argument (a loader's ``(x, y)`` passed whole, ``model(batch)``) at ``depth`` 2."""
    if isinstance(obj, torch.Tensor):
        yield obj, under or named_target((name,))
    elif isinstance(obj, (list, tuple)):
        pair = depth >= 2 and len(obj) == 2
        for i, v in enumerate(obj):
            yield from _walk(v, None, depth + 1, under or (pair and i == 1))
    elif isinstance(obj, dict) or (obj := described(obj)) is not None:
        for k, v in obj.items() if isinstance(obj, dict) else obj[2]:
            yield from _walk(v, k, depth + 1, under)


def input_targets(args: tuple, kwargs: dict, model: Any) -> frozenset[int]:
    """The ids of the loss targets among a root call's arguments to ``model`` (a replay's
    rebuilt model: the recorded one's ``forward`` names them)."""
    return target_ids(named_args(tuple(args), kwargs or {}, forward_names(model)))
