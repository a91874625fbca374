"""Where a model's tensors live, for the op finder: its parameters and buffers (values made
from them alone are the weights', not the batch's: ``OpFinder.held``) and its mask buffers
(+-inf by design, never an origin)."""

from __future__ import annotations

import torch

from recorder.finite import ends, pair_ok


def state_of(*objs) -> set[tuple[int, tuple | None]]:
    """(data_ptr, shape) of the parameters and buffers of each ``nn.Module`` among ``objs``
    (see ``OpFinder.state``), and (storage, None) of each: a view of one is made of it alone
    (``src, dst = self.edges``, the rows of a mesh's edge index buffer), though no op the
    finder sees made it."""
    held = [t for m in objs if isinstance(m, torch.nn.Module)
            for t in (*m.parameters(), *m.buffers())]
    return {(t.data_ptr(), tuple(t.shape)) for t in held} | \
        {(s, None) for t in held if (s := storage_of(t)) is not None}


def storage_of(t: torch.Tensor) -> int | None:
    """Where ``t``'s values live (shared by its views), or None (sparse, nested, subclass)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def mask_buffers(model: torch.nn.Module) -> dict[int, str]:
    """The model's buffers holding +-inf and no NaN (causal masks), by storage."""
    out = {}
    for name, b in model.named_buffers():
        if b.is_floating_point() and b.numel() and not b.is_meta:
            lo, hi = ends(b).tolist()
            if not pair_ok(lo, hi) and pair_ok(lo, hi, allow_inf=True):
                out[storage_of(b)] = name
    out.pop(None, None)
    return out
