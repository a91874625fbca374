"""An input event on a batch tensor or loss argument of a narrow type (float16: largest value
65504) that holds ±Inf and no NaN: the likeliest origin is a cast. ``x.half()`` of a value
beyond the type's range is ±inf, so a float16 data pipeline, or targets cast to a half model's
dtype, turns an extrapolation range's large values into infinities no record ever held. The
data-pipeline hints (bad files, a std of 0, a teacher's output) do not say so. A wider tensor's
-Inf alone is a log of 0 instead (``replay.log_zero_input``)."""

from __future__ import annotations

from typing import Any

import torch

from recorder.finite import has_nan

from .cause_text import HINTS
from .load import Step
from .log_zero_input import log_zero_lead
from .recorded import input_hint, input_key

CAST = ("{tensor} is {dtype} and holds {kind} but no NaN: {dtype}'s largest value is {top:g}, "
        "and a value beyond it becomes {kind} when cast to {dtype} (x.half(), a {dtype} data "
        "pipeline, targets cast to a half model's dtype), which no record need hold: keep it "
        "in float32 (autocast computes in {dtype} where that is safe) or rescale it before the "
        "cast. If nothing cast it: ")


def _narrow(dtype: torch.dtype) -> bool:
    """A floating type whose range float32 values overflow (float16, the float8 types)."""
    return dtype.is_floating_point and torch.finfo(dtype).max < torch.finfo(torch.float32).max


def _tensor(step: Step, origin: dict[str, Any]) -> torch.Tensor | None:
    """The bundle's tensor the input origin names: a batch tensor or a loss argument."""
    key = input_key(step, origin)
    return step.tensors.get(key) if key else None


def cast_overflow(step: Step, origin: dict[str, Any], hint: str) -> str:
    """``hint`` led by the cast's overflow when the origin's tensor is of a narrow type and
    holds infinities only; else ``hint`` unchanged."""
    t = _tensor(step, origin)
    if t is None or not _narrow(t.dtype) or has_nan(t) or not bool(torch.isinf(t).any()):
        return hint
    pos, neg = bool((t == float("inf")).any()), bool((t == float("-inf")).any())
    kind = "+Inf and -Inf" if pos and neg else "+Inf" if pos else "-Inf"
    lead = CAST.format(tensor=origin.get("tensor"), dtype=str(t.dtype).removeprefix("torch."),
                       kind=kind, top=torch.finfo(t.dtype).max)
    return lead + hint


def data_hint(origin: dict[str, Any], step: Step) -> str:
    """:func:`replay.recorded.input_hint` (else the data pipeline's hint, led by a log of 0
    where a wide tensor holds -Inf alone), led by a cast's overflow where the tensor's type and
    values point to one."""
    hint = input_hint(origin, step)
    if hint is None:
        t = _tensor(step, origin)
        wide = t is not None and not _narrow(t.dtype)
        hint = log_zero_lead(t if wide else None, origin.get("tensor"), HINTS["input"])
    return cast_overflow(step, origin, hint)
