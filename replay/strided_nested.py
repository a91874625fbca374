"""Ops on strided nested tensors inside the op finder. torch's math attention converts a
jagged (``layout=torch.jagged``) query, key and value to strided nested tensors, whose backend
refuses most ops (``!=``, ``abs``, comparisons): the finder's trackers, which read an op's values
with such ops, pass these calls over rather than fail the op finder's whole re-run."""

from __future__ import annotations

import torch

from .compat import tree_leaves


def strided_nested(t) -> bool:
    """``t`` is a nested tensor of the strided layout (not a jagged one, whose ops run)."""
    return isinstance(t, torch.Tensor) and t.is_nested and t.layout == torch.strided


def on_strided_nested(leaves: list, out) -> bool:
    """An op took or made a strided nested tensor."""
    return any(strided_nested(t) for t in leaves) or any(strided_nested(t)
                                                          for t in tree_leaves(out))
