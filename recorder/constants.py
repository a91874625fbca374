"""Frozen parameters that hold an infinity on purpose. shiretzet/PointerNet keeps its mask
value as ``nn.Parameter(torch.FloatTensor([float('-inf')]), requires_grad=False)`` and writes
it in with ``att[mask] = self.inf[mask]``: a constant, a buffer in all but name. A frozen
parameter the optimizer does not hold, every element of it ±inf as the recorder attached, is
no weight a step began bad with while it still holds those values: the NaN its ``-inf`` makes
(a softmax of a fully masked row) is the forward's event, as a causal mask buffer's is.
"""

from __future__ import annotations

import torch

from .shards import local

# a mask value is a few elements: the check at attach never reads a large frozen weight
_SMALL = 4096


def inf_constants(params: list[tuple[str, torch.Tensor]], held: set[int]
                  ) -> dict[int, torch.Tensor]:
    """Index -> a copy, for the frozen parameters (no grad, not in the optimizer ``held``,
    by id) whose every element is ±inf."""
    out = {}
    for i, (_, p) in enumerate(params):
        if p.requires_grad or id(p) in held or not p.is_floating_point() \
                or not 0 < p.numel() <= _SMALL or p.is_meta:
            continue
        t = local(p).detach()
        if bool(torch.isinf(t).all()):
            out[i] = t.clone()
    return out


def unchanged(constants: dict[int, torch.Tensor], i: int, p: torch.Tensor) -> bool:
    """Parameter ``i`` is such a constant and holds what it held at attach."""
    c = constants.get(i)
    t = local(p).detach()
    return c is not None and t.shape == c.shape and bool(torch.equal(t, c))
