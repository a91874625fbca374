"""An optimizer setting beyond the weights' dtype: ``optimizer.step()`` raised torch's "value
cannot be converted to type float without overflow" (Adam's single-tensor update given
``lr=1e39`` multiplies a float32 weight by ``-lr``, a Python number float32 cannot hold).

No value of the step is non-finite, so no event and no bundle: the exception goes on with a
note naming the parameter group's setting and the dtype's largest value, so the traceback
says what to change rather than only where torch refused it.
"""

from __future__ import annotations

import math

import torch

_OVERFLOW = "cannot be converted to type"


def scalar_overflow_note(exc: BaseException, optimizer, step: int) -> str | None:
    """The note for ``exc`` when it is torch's scalar overflow and a number setting of one of
    ``optimizer``'s parameter groups is beyond its parameters' dtype, else None."""
    if optimizer is None or _OVERFLOW not in str(exc) or "overflow" not in str(exc):
        return None
    found = []
    for i, group in enumerate(optimizer.param_groups):
        dtypes = {p.dtype for p in group["params"] if p.is_floating_point()}
        if not dtypes:
            continue
        dtype = min(dtypes, key=lambda d: torch.finfo(d).max)  # (the narrowest)
        largest = torch.finfo(dtype).max
        for key, value in group.items():
            if _number(value) and (math.isinf(value) or abs(value) > largest):
                found.append((i, key, value, dtype, largest))
    if not found:
        return None
    i, key, value, dtype, largest = found[0]
    where = f"param group {i}'s" if len(optimizer.param_groups) > 1 else "its"
    return (f"nanreplay: {type(optimizer).__name__}.step() of step {step} raised because "
            f"{where} {key}={value:g} is beyond {str(dtype).removeprefix('torch.')}'s largest "
            f"finite value {largest:.3g}, the dtype of the weights it updates: the update "
            f"cannot hold it, whatever the gradients; set a finite {key} (no value of the "
            "step was non-finite, so no bundle was written)")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
