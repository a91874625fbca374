"""The samples in the rows of a module call's inputs that its caller picked out of the batch.

Kornia applies each augmentation to the samples its probability drew, in its caller's code:
``out[to_apply] = self.transform(x[to_apply])``. The transform's call, where the op finder
looks, gets ``k`` of the batch's rows, which name no sample by their position; its row ``r``
is the sample of the mask's ``r``-th true element. :class:`CallerPicks` watches the forward
from the root call's start to that call with a :class:`replay.reordered.Reordered`, which
follows such picks (and ``x[order]``, ``flip``), so the finder can start from what the
caller's code did to the rows of what it passes on.

It follows the samples' dimension there too (:class:`replay.moved.Moved`): ST-GCN folds the
persons of each clip into the batch before its blocks, ``x.permute(0, 4, 3, 1, 2)`` then
``.reshape(N * M, C, T, V)``, so a block's row ``r`` is sample ``r // M``, which the block's
own ops cannot tell.
"""

from __future__ import annotations

from typing import Any

import torch

from recorder.samples import Samples

from .compat import TorchDispatchMode, tree_leaves
from .moved import Moved
from .reordered import Reordered


class CallerPicks(TorchDispatchMode):
    """Entered around the whole re-run, outermost (a mode entered or left inside the forward
    would be undone by ``torch.inference_mode()``'s exit, which restores the dispatch keys it
    found: a teacher run under it in the forward); it follows the rows while ``watching``."""

    def __init__(self, samples: Samples | None):
        super().__init__()
        self.reordered = Reordered(samples.size if samples and samples.size else 0)
        self.moved = Moved(samples)
        self.watching = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)  # (as no mode: what the op raises is the model's)
        if self.watching:
            name, leaves = func.overloadpacket.__name__, tree_leaves((args, kwargs))
            self.reordered.track(name, args, leaves, out)
            self.moved.track(name, args, leaves, out)
        return out

    def hand_on(self, args: Any, to: Reordered, moved: Moved) -> None:
        """Gives ``to`` the samples in the rows of the call's input tensors ``args``, and
        ``moved`` where their samples are when the caller moved or folded them; stops
        watching."""
        self.watching = False
        for t in tree_leaves(args):
            if isinstance(t, torch.Tensor) and (order := self.reordered.order(t)) is not None:
                to.follow(t, order)
            if isinstance(t, torch.Tensor) and (place := self.moved.place(t)) is not None:
                moved.follow(t, place)
