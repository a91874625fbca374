"""Weights whose finite values are all float16 values and whose non-finite ones are only
infinities: the tensor went through float16 on its way in (a checkpoint saved with
``.half()`` to halve its size, a ``model.half()`` round trip, weights exported for float16
inference), where a value beyond float16's largest, 65504, became ``inf``; loaded into a
float32 model, the infinities came with it. Float32 training leaves few values exactly
representable in float16, so a tensor of many distinct ones all so is evidence of the cast, and
the generic advice for some non-finite elements (an element-wise division by 0) points away
from it.
"""

from __future__ import annotations

import torch

__all__ = ["half_cast_text"]

_DISTINCT = 8  # finite values distinct and not whole numbers, so that being float16's is telling


def half_cast_text(name: str, t: torch.Tensor) -> str | None:
    """What a float16 cast says about ``t``'s non-finite elements (see the module); None when
    ``t`` is no wider type's tensor that went through float16, or holds a NaN."""
    if t.dtype not in (torch.float32, torch.float64):
        return None
    t = t.detach()
    fin = torch.isfinite(t)
    if bool(fin.all()) or bool(torch.isnan(t).any()):
        return None
    v = t[fin]
    frac = v[v != v.round()]
    if frac.unique().numel() < _DISTINCT or not bool((v.half().to(v.dtype) == v).all()):
        return None
    n = int((~fin).sum())
    return (f"every finite value of {name} is a float16 value (exactly representable in "
            f"float16, which {str(t.dtype).removeprefix('torch.')} training leaves few values) "
            f"and its {n} non-finite element{'s are' if n > 1 else ' is'} only inf: it went "
            "through float16 on its way in (a checkpoint saved with .half(), a model.half() "
            "round trip), where a value beyond float16's largest, 65504, becomes inf; load a "
            "float32 copy of the weights, or save in float32 or bfloat16 (float32's range)")
