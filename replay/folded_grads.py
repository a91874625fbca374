"""The samples of a backward node's gradient for a value whose samples the forward folded.

ST-GCN folds each clip's persons into the batch before its blocks,
``x.permute(0, 4, 3, 1, 2)...reshape(N * M, C, T, V)``: a node of a block returns gradients of
shape ``(N * M, ...)``, whose rows name no sample by their shape (row ``r`` is clip
``r // M``). :class:`FoldedGrads` follows the forward with a :class:`replay.moved.Moved`, as
the op finder does, and keeps where each value's samples went, by the autograd node that made
the value (seen when an op takes it, where its ``grad_fn`` is set): the gradient a node returns
for that value has its shape, so its samples are there too.
"""

from __future__ import annotations

import torch

from recorder.finite import bad_rows, finite
from recorder.samples import Samples

from .compat import TorchDispatchMode, tree_leaves
from .moved import Moved, Place


class FoldedGrads(TorchDispatchMode):
    def __init__(self, samples: Samples):
        super().__init__()
        self.moved = Moved(samples)
        self._at: dict[tuple, Place] = {}  # (grad_fn, output_nr) -> where its samples are

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)  # (as no mode: what the op raises is the model's)
        leaves = tree_leaves((args, kwargs))
        self.moved.track(func.overloadpacket.__name__, args, leaves, out)
        for t in leaves:
            if isinstance(t, torch.Tensor) and t.grad_fn is not None \
                    and (p := self.moved.place(t)) is not None:
                self._at[(t.grad_fn, t.output_nr)] = p
        return out

    def rows(self, node, returned) -> list[int]:
        """The samples of the first non-finite gradient ``node`` returned for a value whose
        samples the forward moved ([] when none)."""
        size = self.moved.samples.size if self.moved.samples else 0
        for nxt, g in zip(node.next_functions, returned):
            p = self._at.get(nxt) if nxt[0] is not None else None
            if p is not None and isinstance(g, torch.Tensor) and g.dim() > p[0] \
                    and g.shape[p[0]] == size * p[1] * p[2] and not finite(g):
                return sorted({(r // p[1]) % size for r in bad_rows(g, p[0])})
        return []
