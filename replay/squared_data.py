"""An overflow of a square (``pow(r, 2)``, ``r * r``, a norm) whose input is at the scale of a
batch tensor that no square of fits the step's type: data in raw units.

A GP's marginal log likelihood squares the whitened residual of its targets; outcomes of 1e25
(a cost in raw currency, a simulator's energy) kept in float32 without an outcome transform
make ``pow(r, 2)`` beyond float32's 3.4e38 whatever the hyper-parameters. The overflow's
generic advice (subtract a row max before exp, bound a learned exponent) is not it: the hint
names the batch tensor and its largest value, and says to standardise it where the data is
made (BoTorch's ``Standardize`` outcome transform) or to compute in float64.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .cause_text import DO
from .empty_counts import root_inputs
from .load import Step

# ops that square (or multiply by itself) what they take
_SQUARING = {"aten.pow", "aten.mul", "aten.square", "aten.linalg_vector_norm", "aten.norm",
             "aten.mm", "aten.bmm", "aten.matmul", "aten.dot"}
_GENERIC = (DO["wider64_exp"], DO["wider64"])


def squared_data_hint(report: dict[str, Any], step: Step) -> None:
    """Replace an overflowed square's generic advice when a batch tensor is at its input's
    scale and beyond the square root of its type's largest value."""
    o, hint = report.get("origin") or {}, report.get("hint") or ""
    dtype = getattr(torch, str(o.get("dtype")), None)
    span = o.get("input_range") or []
    if report.get("cause") != "overflow" or o.get("op") not in _SQUARING \
            or not isinstance(dtype, torch.dtype) or not dtype.is_floating_point \
            or len(span) != 2 or not hint.endswith(_GENERIC):
        return
    top, root = max(abs(float(v)) for v in span), math.sqrt(torch.finfo(dtype).max)
    if not math.isfinite(top) or top < root:
        return
    for name, t, _ in root_inputs(step, o.get("micro_batch") or 0, scalars=True):
        big = float(t.detach().abs().max())
        if math.isfinite(big) and big >= root and big >= 0.1 * top:  # (the op's own scale)
            tail = next(s for s in _GENERIC if hint.endswith(s))
            kind = str(dtype).removeprefix("torch.")
            report["hint"] = hint[:-len(tail)].rstrip().rstrip(":") + (
                f"; its input is at the scale of the batch's {name}, which holds values up to "
                f"{big:.3g}, beyond {root:.3g}, the largest whose square {kind} holds: the "
                "data is in raw units no squared error fits in. Standardise it where the data "
                "is made or by the model (BoTorch's Standardize(m=1) outcome transform, "
                "(y - y.mean()) / y.std(), a cost in thousands instead of units), or compute "
                "in float64")
            return
