"""The eps a half type resolves below 1, for a unit pole rounding reached in it.

Poincare embeddings kept in float16 (a large table) with hyptorch's artanh, which clamps to
``1 - 1e-5``: in float16 the largest number below 1 is ``1 - 2**-11`` (about ``1 - 4.9e-4``),
so the clamp rounds to 1 and atanh's derivative is infinite there. The atanh advice names
float32's eps (the one the code already wrote); :func:`narrow_eps` says the one the type needs.
"""

from __future__ import annotations

import math

import torch

__all__ = ["narrow_eps"]

_UNIT = {"Atanh", "Acosh", "Acos", "Asin"}


def narrow_eps(node: str | None, dtype: torch.dtype | None, package: str | None = None) -> str:
    """For a backward ``node`` of a unit pole in a type narrower than float32, the step below
    1 that type resolves and an eps above it; else "". ``package``: the installed package
    whose line the op is (pytorch-metric-learning's ArcFace, ``acos(clamp(cos, -1, 1))``),
    whose clamp the training code cannot change: float32 is then the remedy to name."""
    if dtype is None or not dtype.is_floating_point or torch.finfo(dtype).bits >= 32 \
            or (node or "").removesuffix("Backward0").removesuffix("Backward1") not in _UNIT:
        return ""
    below = torch.finfo(dtype).eps / 2  # (the spacing just below 1, half that above it)
    eps = 10.0 ** math.ceil(math.log10(below))
    name = str(dtype).removeprefix("torch.")
    said = (f"; in {name} the largest number below 1 is 1 - {below:.2g}, so 1 - eps of a "
            f"smaller eps (float32's 1e-5) is 1: clamp with an eps of at least {eps:g} there, "
            "or compute these ops in float32")
    if package:
        said += (f". The op's line is the installed package {package}'s, not the training "
                 f"code's: rather than edit it, run that call in float32 (call it outside "
                 f"autocast, torch.autocast(..., enabled=False), with its inputs .float())")
    return said
