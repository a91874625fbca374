"""Which of several ``allow_nan`` root inputs holding NaN let one get past the model's handling.

The recorder names the first root input holding NaN, but when several may hold missing values
(a forecaster's observed past and its teacher-forced future, both NaN for absent agents) the
model may impute one and feed the other on as it is. The re-run tells them apart: with one
input's NaN set to 0, the forward's outputs stay NaN while another's still leaks, and come
out NaN-free once the leaking one's are.
"""

from __future__ import annotations

from typing import Any

import torch

from recorder.capture import batch_path
from recorder.finite import has_nan
from recorder.missing import root_input_name

from .load import Step, micro_batch_inputs
from .recorded import nan_allowed, samples


def _held(step: Step, mb: int) -> list[tuple[str, str]]:
    """(bundle key, raw path) of micro-batch ``mb``'s allow_nan root inputs holding NaN."""
    paths = step.micro_batches[mb].get("paths", {}) if step.micro_batches else {}
    return [(k, raw) for k, raw in paths.items() if k in step.tensors
            and nan_allowed(step, root_input_name(raw)) and has_nan(step.tensors[k])]


def leaking_input(step: Step, origin: dict[str, Any], nan_left) -> dict[str, Any] | None:
    """The origin's fields naming the one allow_nan input whose NaN, set to 0, leaves the
    re-run's outputs NaN-free, when the event named another; else None. ``nan_left(mb)``:
    whether the re-run's forward of micro-batch ``mb`` put out a NaN."""
    mb = origin.get("micro_batch") or 0
    held = _held(step, mb)
    if len(held) < 2:
        return None
    leaks = []
    for key, raw in held:
        kept = step.tensors[key]
        step.tensors[key] = torch.nan_to_num(kept, nan=0.0, posinf=float("inf"),
                                             neginf=float("-inf"))
        try:
            if not nan_left(mb):
                leaks.append((key, raw))
        finally:
            step.tensors[key] = kept
    if len(leaks) != 1:
        return None
    key, raw = leaks[0]
    name = batch_path(raw, len(micro_batch_inputs(step, mb)[0]))
    if name == origin.get("tensor"):
        return None
    rows = samples(step, mb).rows(step.tensors[key])
    seen = [r for r in rows if r in (step.event.get("samples") or [])]
    return {"tensor": name, "samples": seen or rows}
