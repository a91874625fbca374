"""An overflow in a cast to a float8 type: FP8 training written by hand (Transformer Engine's
recipes, torchao's float8) casts ``x * scale`` to ``float8_e4m3fn`` / ``float8_e5m2`` on
purpose, so "compute it in float32" is no fix. A value beyond the type's largest means the
cast was not saturated (e5m2 keeps inf; torchao's ``to_fp8_saturated`` clamps first) or the
scale was too large for this tensor: delayed scaling takes it from an amax history of earlier
steps, which a larger value in this step exceeds."""

from __future__ import annotations

import torch

from recorder.finite import FLOAT8

# the ops a dtype conversion dispatches to
_CASTS = {"aten._to_copy", "aten.to", "aten.copy_"}

FLOAT8_CAST = (
    "the cast to {dt} is the FP8 recipe's own: saturate before it (x.clamp(-{top:g}, {top:g}), "
    "as torchao's to_fp8_saturated does), or make the scale fit this tensor: a delayed scale "
    "(fp8_max / the largest amax of an amax history of earlier steps) overflows on a value "
    "larger than the history's amax; take it from the current amax (dynamic scaling) or "
    "leave a margin (scale / 2**margin, Transformer Engine's DelayedScaling(margin=...))")


def float8_cast_advice(op: str | None, dtype: torch.dtype) -> str | None:
    """What to do about ``op``'s overflow when it is a cast to a float8 ``dtype``, else None."""
    if op is None or dtype not in FLOAT8 or op not in _CASTS:
        return None
    return FLOAT8_CAST.format(dt=str(dtype).removeprefix("torch."), top=torch.finfo(dtype).max)
