"""Root inputs passed under a loss target's name (``labels=``, as a Hugging Face model that
computes its own loss takes them, and as the ``Trainer`` passes them): the values the loss
compares, never a graph batch's assignment vector. A batch's class labels sorted by chance
(``[0, 1, 2, 2]``; all ``0`` in an imbalanced binary task) read as one (integers from 0, never
decreasing, below their count), and the batch's rows were named as graphs: a batch of 4 taken
as 3 samples, its fourth row named as the third."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from .objects import described

# the keyword (or batch key) names of a loss target: transformers' ``labels``, PyG's ``y``
TARGET_NAMES = frozenset({"labels", "label", "targets", "target", "y"})


def named_target(path: tuple) -> bool:
    """A structure's ``path`` (its keys and indices from the root) ends in a target's name."""
    return bool(path) and path[-1] in TARGET_NAMES


def untargeted(obj: Any, name: Any = None) -> Iterator[torch.Tensor]:
    """The tensors in a nested structure of tuples, lists, dicts and batch objects, less
    those held under a target's name (:data:`TARGET_NAMES`)."""
    if isinstance(obj, torch.Tensor):
        if not named_target((name,)):
            yield obj
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from untargeted(v)
    elif isinstance(obj, dict) or (obj := described(obj)) is not None:
        for k, v in obj.items() if isinstance(obj, dict) else obj[2]:
            yield from untargeted(v, k)
