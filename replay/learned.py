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
from .storages import state_of, storage_of


class Learned:
    """The storages of the model's parameters and buffers, and of every tensor an op made
    from one of them. By storage, not by tensor: a solver that writes into buffers it
    allocated (locuslab/deq's Anderson step, ``H[:, 1:, 1:] = G @ G.mT``) makes the matrix
    it solves a view of a storage the weights went into, which no op returned as such."""

    def __init__(self, model: torch.nn.Module):
        self._storages = {s for s, shape in state_of(model) if shape is None}

    def __contains__(self, t: torch.Tensor) -> bool:
        return storage_of(t) in self._storages

    def track(self, args: Any, out: Any) -> None:
        """Marks ``out``'s storages (an in-place op's: the tensor it wrote) when the op took
        (in ``args``) a learned tensor."""
        if any(isinstance(t, torch.Tensor) and t in self for t in tree_leaves(args)):
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and (s := storage_of(t)) is not None:
                    self._storages.add(s)
