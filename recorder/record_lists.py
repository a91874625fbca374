"""A list of tensors that holds one entry per sample, not one argument per entry.

torchvision's detection models take a list of images of different sizes; a collate_fn that
leaves variable-length records unpadded (``[x for x, _ in items]``) hands the model a list of
feature vectors or ``(T_i, F)`` sequences that its forward stacks or pads. A tensor of such a
list holds no dimension of the batch: the sample it is is its index in the list. A list of
batches (``(moving, fixed)`` volumes, an ``(x, adj)`` pair) is no such list: its tensors lead
with the batch's size or differ in their last one.
"""

from __future__ import annotations

import torch


def tensor_records(o: list | tuple) -> bool:
    """``o`` reads as one floating tensor per sample: 2 or more of one number of dims, not all
    leading with ``len(o)``; images or clips of 3 or more dims, or feature vectors and
    sequences of 1 or 2 dims that share their last size (the features)."""
    if len(o) < 2 or not all(isinstance(e, torch.Tensor) and e.is_floating_point()
                             and not e.is_nested and e.dim() for e in o):
        return False
    if len({e.dim() for e in o}) != 1 or all(e.shape[0] == len(o) for e in o):
        return False
    return o[0].dim() >= 3 or len({e.shape[-1] for e in o}) == 1


def listed_records(obj, made: set[int], lead: set[int]) -> int:
    """The length of ``obj`` when it is such a list of data (no tensor of it the model made:
    ``made`` by id, or autograd) and a root output leads with it (the batch's size: a stack of
    3 records' vectors in a last short batch, whatever the records' own sizes say), else 0."""
    if not isinstance(obj, (list, tuple)) or len(obj) not in lead or not tensor_records(obj):
        return 0
    return len(obj) if all(e.grad_fn is None and id(e) not in made for e in obj) else 0
