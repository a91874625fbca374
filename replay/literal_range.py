"""A constant written in the code that the op's type cannot hold. Attention and memory code
written for float32 masks with a large finite number (``scores + (1 - mask) * -1e9``, or
``-1e10``): under float16 autocast that constant is beyond the type's largest value, 6.55e4,
so the product is ``-inf``, and a row whose every slot is masked (a story with no sentence)
is a softmax of ``-inf`` only, NaN, where float32 gave a uniform row. The fix is the constant,
taken from the type (``torch.finfo(scores.dtype).min``), not the op's precision. In float32
or wider such a number was grown by the code (an interior-point method's ``t *= mu``).
"""

from __future__ import annotations

import math

import torch

from .domains import g


def unheld_literal(ev) -> float | None:
    """A finite number among the op's non-tensor arguments beyond the largest value of the
    type it computed in (``ev``: :class:`~replay.hits.Evidence`), else None."""
    top = torch.finfo(ev.dtype).max
    return next((float(a) for a in ev.args if isinstance(a, (int, float))
                 and not isinstance(a, bool) and math.isfinite(a) and abs(a) > top), None)


def literal_hint(op: str, value: float, dtype: torch.dtype) -> str:
    dt = str(dtype).removeprefix("torch.")
    end = "min" if value < 0 else "max"
    if torch.finfo(dtype).bits >= 32:  # (no autocast's half type: a number the code grew)
        return (f"{op} was given the number {g(value)}, which {dt} cannot hold (its largest "
                f"value is {g(torch.finfo(dtype).max)}), so it is {'-' if value < 0 else '+'}"
                "inf there: a Python number the code grew past the type (a barrier "
                "parameter raised each round, t *= mu; a scale or temperature annealed "
                "geometrically): cap it, stop raising it once its target is met (a duality "
                f"gap {dt} can resolve), or compute that part in float64")
    return (f"{op} was given the constant {g(value)}, which {dt} cannot hold (its largest "
            f"value is {g(torch.finfo(dtype).max)}), so it is {'-' if value < 0 else '+'}inf "
            f"there: a value written for float32 (a mask's -1e9) does not survive {dt} "
            f"(autocast); take it from the type, torch.finfo(x.dtype).{end} for a mask, or "
            "use a value the type holds")
