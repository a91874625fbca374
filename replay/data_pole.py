"""A log's or root's argument outside its domain that the batch itself holds at the samples
named: a missing-value code, not a value the model computed.

Tabular and click-through-rate pipelines fill a missing count with -1 (``fillna(-1)``) and the
model log1p's the counts in forward: log1p(-1) is -inf, and BatchNorm's batch mean spreads it
to every row. The op's own advice (keep the input above -1, ``x.clamp_min(-1 + eps)``) turns
the code into an extreme feature, log(eps). When a batch tensor holds a value at or below the
op's pole in exactly the samples named, and the op's smallest input is that very value, the
hint says the data holds it and to impute it where the data is made.
"""

from __future__ import annotations

from typing import Any

import torch

from recorder.capture import batch_path

from .domains import g
from .load import Step
from .log_domain import ADVICE as LOG_DOMAIN
from .log_domain import CLAMP
from .recorded import n_args

# the ops and the largest value outside their domain (or at their pole): log's 0 is a real
# count of 0 (the log-of-0 advice stands there); a count is never -1 nor below 0
_EDGE = {"log1p": -1.0, "log": -1e-30, "log2": -1e-30, "log10": -1e-30, "sqrt": -1e-30}

AS_GIVEN = "as the batch gave it"  # (what replay.negative_rows defers to)


def nines_code(values: torch.Tensor) -> float | None:
    """The one value ``values`` all hold when it is a run of nines, ``±(10^k - 1)`` with
    k >= 1 (-99, 99, -999, -9999: the missing-value codes of catalogues and surveys, a band not
    observed), else None."""
    if not values.numel() or bool((values != values.flatten()[0]).any()):
        return None
    v = abs(float(values.flatten()[0]))
    return float(values.flatten()[0]) if v >= 9 and str(int(v)) == "9" * len(str(int(v))) \
        and v == int(v) else None


def _measured(values: torch.Tensor) -> bool:
    """Whether the out-of-domain values are no code: not whole numbers (a background-
    subtracted flux of -0.2, a difference of noisy counts)."""
    return bool((values != values.round()).any())


def _what(bad: torch.Tensor) -> str:
    if _measured(bad):
        return ("a measurement that noise or an offset took below the op's domain (a "
                "sky-subtracted flux of a faint source, a difference of noisy counts), no "
                "corrupt record: a clamp or dropping those records biases toward the bright "
                "ones; use a transform defined there (asinh magnitudes, a signed log "
                "sign(x) * log1p(|x|)) or keep such values as upper limits where the data "
                "is made")
    return ("a code for a missing value (fillna(-1)) or a corrupt record, which a clamp "
            "would turn into an extreme feature; impute it where the data is made (a "
            "default such as 0, with a missing-indicator column) or drop those records")


def data_pole_hint(report: dict[str, Any], step: Step) -> None:
    """Append to an invalid log's or root's hint the batch tensor holding its bad value."""
    o = report.get("origin") or {}
    edge = _EDGE.get((o.get("op") or "").removeprefix("aten.").rstrip("_"))
    low = (o.get("input_range") or [None])[0]
    rows = o.get("samples") or []
    if report.get("cause") != "invalid" or edge is None or low is None or low > edge \
            or not rows or o.get("all_samples") or not report.get("hint"):
        return
    i = o.get("micro_batch") or 0
    mb = step.micro_batches[i] if i < len(step.micro_batches) else {}
    for key, raw in (mb.get("paths") or {}).items():
        t = step.tensors.get(key)
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() < 1:
            continue
        bad = (t <= edge).reshape(len(t), -1)
        hit = torch.nonzero(bad.any(1)).flatten().tolist()
        if hit != rows or float(t.min()) != low:
            continue
        cols = sorted(set(torch.nonzero(bad)[:, 1].tolist())) if t.dim() == 2 else []
        where = f" (column {', '.join(map(str, cols))})" if cols else ""
        # (no constraint's slack: the batch's own value, no iterate a step took outside)
        hint = report["hint"].replace(LOG_DOMAIN, CLAMP)
        report["hint"] = (
            f"{hint}. But {batch_path(raw, n_args(mb.get('inputs')))} holds "
            f"{g(low)} at sample(s) {', '.join(map(str, rows))}{where} {AS_GIVEN}, "
            f"the value the op took: {_what(t[t <= edge])}")
        return
