"""Values missing from the data as NaN, which the model handles itself (tabular features that
its ``forward`` imputes with ``torch.nan_to_num`` or ``torch.where(torch.isnan(x), fill, x)``):
the root inputs ``allow_nan`` names, and whether a step whose only NaN came in with the batch
went on finite everywhere else (then the event says how to allow it)."""

from __future__ import annotations

import math
from typing import Any

from .finite import pair_ok


def root_input_name(raw: str) -> str:
    """The root input a batch path (into ``[list(args), kwargs]``) lies in, as ``allow_inf``
    and ``allow_nan`` name it: ``args[i]`` or the keyword."""
    if raw.startswith("[0]["):
        return f"args[{raw[4:].partition(']')[0]}]"
    if raw.startswith("[1]["):
        key = raw[4:].partition("]")[0]
        return key.strip('"') if key.startswith('"') else key
    return raw


def rest_finite(row: list[float], calls: list[dict[str, Any]], layout) -> bool:
    """Every module output, loss, gradient and gradient of the model output of the step is
    finite: a NaN that came in with the batch went no further (the model handled it)."""
    return all(d["outputs_finite"] for d in calls) \
        and all(pair_ok(row[lo], row[hi]) for _, lo, hi in layout.loss) \
        and all(math.isfinite(row[k]) for _, k in layout.grads) \
        and all(math.isfinite(row[k]) for _, _, k in layout.out_grads)


def allow_nan_advice(name: str) -> str:
    """What to do when the model handles the NaN of root input ``name`` on purpose."""
    return (f"the model's outputs, loss and gradients stayed finite: if it handles NaN in "
            f"{name} on purpose (missing values it imputes), record with "
            f"FlightRecorder(..., allow_nan=[{name!r}]); else fix or filter these samples")
