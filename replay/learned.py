"""Which values of a re-run the model's state went into, as the dispatched ops make them.

A decomposition that fails on a per-sample matrix made from the batch alone (kornia's
``crop_and_resize`` solving a homography from each image's box: a box of no width makes the
8x8 system singular) fails because a record is degenerate, not because of anything the model
learned: the fix is in the data, where a ridge or ``lstsq`` would only hide the record.
:class:`Learned` tells such a matrix from one the weights went into (a covariance of
features, a kernel of learned lengthscales).
"""

from __future__ import annotations

from typing import Any

import torch

from .compat import tree_leaves
from .memo import TensorSet
from .storages import state_of, storage_of


class Learned:
    """The model's parameters and buffers, and every tensor an op made from one of them."""

    def __init__(self, model: torch.nn.Module):
        self._state = state_of(model)
        self._made = TensorSet()

    def __contains__(self, t: torch.Tensor) -> bool:
        if t in self._made:
            return True
        try:
            return (t.data_ptr(), tuple(t.shape)) in self._state \
                or (storage_of(t), None) in self._state
        except RuntimeError:  # a tensor without storage
            return False

    def track(self, args: Any, out: Any) -> None:
        """Marks ``out``'s tensors when the op took (in ``args``) a learned one."""
        if any(isinstance(t, torch.Tensor) and t in self for t in tree_leaves(args)):
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self._made.add(t)
