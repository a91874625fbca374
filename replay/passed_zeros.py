"""The op that first made a refused 0, through the ops after it that only passed it on.

A latent NP's scale ``floor + (1 - floor) * sigmoid(raw)`` with the floor set to 0: ``sigmoid``
of a very negative input rounds to 0, and the ``mul`` and ``add`` after it keep those zeros
where they are. The last writer of the refused tensor is the ``add``; the 0 was the
``sigmoid``'s, whose float64 value (an underflow) and advice (a floor on it) are the ones that
apply. An op of one tensor (and numbers) passed a 0 on when every 0 of its output is a 0 of
that tensor; a product with a mask, of two, made its zeros itself.
"""

from __future__ import annotations

from typing import Any

import torch

from recorder.compat import view_base

from .compat import tree_leaves


def _key(t: torch.Tensor) -> int:
    base = view_base(t)
    return (t if base is None else base).data_ptr()


def zeros_maker(out: torch.Tensor, args: Any, kwargs: Any, made: dict[int, Any]) -> Any:
    """The recorded maker (in ``made``, by storage) of the zeros ``out`` took unchanged from
    its one tensor input, of its shape; None when it has no 0, or made one of its own."""
    tensors = [a for a in tree_leaves([args, kwargs])
               if isinstance(a, torch.Tensor) and a.dim()]
    if len(tensors) != 1:  # (x * mask: the mask's 0s are the op's own, as a product's)
        return None
    a = tensors[0]
    if not a.is_floating_point() or a.shape != out.shape or _key(a) not in made:
        return None
    zero = out == 0
    if not bool(zero.any()) or bool((zero & (a != 0)).any()):
        return None
    return made[_key(a)]
