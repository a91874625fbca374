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

__all__ = ["flushed_text", "half_cast_text", "half_values"]

_DISTINCT = 8  # finite values distinct and not whole numbers, so that being float16's is telling


def half_values(v: torch.Tensor) -> bool:
    """Whether the values ``v`` (finite, of a wider type) are all float16 values, of enough
    distinct fractional ones, a quarter of them using float16's every significant bit, for
    that to tell of a cast."""
    if v.dtype not in (torch.float32, torch.float64):
        return False
    v = v.detach()
    frac = v[v != v.round()].unique()
    if frac.numel() < _DISTINCT or not bool((v.half().to(v.dtype) == v).all()):
        return False
    # (and of float16's full 11 significant bits, as a cast of real numbers leaves about half
    # of them: not a grid of fewer bits, allele frequencies k / 512 of a 256-genome cohort)
    mantissa, _ = torch.frexp(frac)
    full = (mantissa * 1024) != (mantissa * 1024).round()
    return 4 * int(full.sum()) >= frac.numel()


def flushed_text(name: str, t: torch.Tensor) -> str | None:
    """Of a tensor with exact 0s divided by (a variance buffer), whose values are all float16
    values: a value below float16's smallest subnormal (6e-8) that the cast made 0; None when
    not so."""
    t = t.detach()
    if not bool(torch.isfinite(t).all()) or not bool((t == 0).any()) or not half_values(t):
        return None
    return (f"Every value of {name} is a float16 value (exactly representable in float16, "
            "which float32 statistics leave few values): it went through float16 on its way "
            "in (a checkpoint saved with .half(), a model.half() round trip), which makes 0 of "
            "a value below float16's smallest, 6e-8 (a variance of 1e-8: an underflow, not a "
            "statistic that was 0); load a float32 copy, keep such buffers in float32 when "
            "saving, or floor the divisor (.clamp_min(eps))")


def half_cast_text(name: str, t: torch.Tensor) -> str | None:
    """What a float16 cast says about ``t``'s non-finite elements (see the module); None when
    ``t`` is no wider type's tensor that went through float16, or holds a NaN."""
    if t.dtype not in (torch.float32, torch.float64):
        return None
    t = t.detach()
    fin = torch.isfinite(t)
    if bool(fin.all()) or bool(torch.isnan(t).any()):
        return None
    if not half_values(t[fin]):
        return None
    n = int((~fin).sum())
    return (f"every finite value of {name} is a float16 value (exactly representable in "
            f"float16, which {str(t.dtype).removeprefix('torch.')} training leaves few values) "
            f"and its {n} non-finite element{'s are' if n > 1 else ' is'} only inf: it went "
            "through float16 on its way in (a checkpoint saved with .half(), a model.half() "
            "round trip), where a value beyond float16's largest, 65504, becomes inf; load a "
            "float32 copy of the weights, or save in float32 or bfloat16 (float32's range)")
