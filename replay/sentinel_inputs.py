"""A model input that holds a missing-value code (-999, 9999) exactly where a 0/1 mask of the
same batch is 0: the missing entries reach the model as that number.

Survey and test data files code a missing response as -999 (or -9, 9999); the loop builds a
mask of the observed entries, gives it to the model beside the data, and forgets to zero
those entries first. An amortised encoder (VIBO's over a student's response row) then turns
each missing one into an ability thousands of units out, its sigmoid rounds to 1, and the
hand-written BCE's ``log(1 - p)`` is -inf. The op's own advice (the logits form, an eps)
would only hide that the model trains on the code as data; the hint says which input holds
it, in which samples, so the user zeroes it (``x * mask``) before the model sees it.
"""

from __future__ import annotations

from typing import Any

import torch

from recorder.finite import zero_one

from .load import Step
from .outliers import row_values

FACTOR = 10.0  # the code's magnitude against every observed entry's largest


def sentinel_inputs_hint(report: dict[str, Any], step: Step) -> None:
    """Append the model input coded with a constant at a mask's 0s, when every sample the
    origin names holds that code."""
    o, hint = report.get("origin") or {}, report.get("hint")
    mb, rows = o.get("micro_batch") or 0, o.get("samples") or []
    if not hint or not rows or mb >= len(step.micro_batches):
        return
    inputs = set(step.micro_batches[mb].get("paths") or {})
    values = [(key, name, v) for key, name, missing, v in row_values(step, mb) if not missing]
    masks = [(name, v) for _, name, v in values if _zero_one(v)]
    for key, name, x in values:
        if key not in inputs:
            continue
        for mask_name, m in masks:
            found = _coded(x, m)
            if found is None or mask_name == name:
                continue
            code, coded_rows = found
            if set(rows) <= coded_rows:
                report["hint"] = f"{hint}. " + _text(name, mask_name, code, sorted(coded_rows))
                return


def _zero_one(v: torch.Tensor) -> bool:
    return zero_one(v) and bool((v == 0).any())


def _coded(x: torch.Tensor, m: torch.Tensor) -> tuple[float, set[int]] | None:
    """(the one value ``x`` holds wherever ``m`` is 0, the rows holding it) when that value is
    FACTOR times larger than every finite entry where ``m`` is 1, else None (also for 0: a
    batch already masked, ``x * mask``, whose NaN made ``max`` NaN and every code "larger")."""
    if x.shape != m.shape:
        return None
    off, on = x[m == 0], x[m == 1]
    on = on[on.isfinite()]  # a NaN observed entry (the event's own) compares with nothing
    if not off.numel() or not on.numel() or not bool((off == off[0]).all()):
        return None
    code = float(off[0])  # 0 (or the -0 of x * mask): the entries are zeroed already
    if code == 0 or abs(code) < FACTOR * max(float(on.abs().max()), 1.0):
        return None
    return code, {int(r) for r in (m == 0).any(1).nonzero().flatten()}


def _text(name: str, mask_name: str, code: float, rows: list[int]) -> str:
    which = ",".join(str(r) for r in rows)
    return (f"But the model input {name} holds {code:g} at every entry where {mask_name} "
            f"(0/1) is 0 (in sample(s) {which}), 10x any observed entry: missing values coded "
            f"as {code:g} reach the model as data, which drove it there; zero them before the "
            f"model sees them (x * mask, torch.where(mask.bool(), x, 0)) rather than fix the "
            f"op")
