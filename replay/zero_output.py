"""A loss's pole at 0 (a division by 0, a log of 0) where the model's output, never negative,
is exactly 0 at entries whose data the loss compares it with is positive: the prediction puts
no mass where the data has some. ``kl_divergence(target, q)`` of a histogram ``q`` predicted
as rectified scores normalised to sum 1 (``relu(s) / relu(s).sum()``): a bin at exactly 0
where the target holds mass makes ``p / q`` inf; Itakura-Saito's ``t / y`` and a relative
error divided by the prediction have the same pole. The op's advice (an eps in the
denominator, skip the rows) does not say that the divisor is the prediction's support."""

from __future__ import annotations

from typing import Any

import torch

from .load import Step
from .perfect_fit import outputs_and_data

# (the pole texts of replay.domains: "by 0 (x/0, a pole)", "of 0 (a pole: 1/0)", log's)
_AT_ZERO = ("by 0 (", "of 0 (")


def zero_output_hint(report: dict[str, Any], step: Step) -> None:
    """Append to a loss origin's pole at 0 the model output's exact zeros under positive data."""
    o, hint = report.get("origin") or {}, report.get("hint") or ""
    mb = o.get("micro_batch") or 0
    rows = [r for r in o.get("samples") or () if isinstance(r, int) and r >= 0]
    if report.get("cause") != "invalid" or o.get("phase") != "loss" or not rows \
            or not any(z in hint for z in _AT_ZERO) or "perfect fit" in hint \
            or "the spread of" in hint or mb >= len(step.micro_batches):
        return
    found = _zeros_under_data(step, mb, rows)
    if found is None:
        return
    made, n, name = found
    report["hint"] = (
        f"{hint}; the divisor is the prediction's support: {made}, never negative, is exactly "
        f"0 at {n} entries of samples {rows} where {name}, which the loss compares it with, "
        "is positive, and a ratio or log of the prediction there (KL(p || q) of a predicted "
        "q, Itakura-Saito's t / y, a relative error divided by the prediction) is infinite: "
        "give the output a floor above 0 (a softmax or softplus head instead of a ReLU's "
        "exact zeros, or q.clamp_min(eps) renormalised), or compute in log space "
        "(log_softmax; torchmetrics' kl_divergence(..., log_prob=True))")


def _zeros_under_data(step: Step, mb: int, rows: list[int]):
    """(the output's name, how many entries, the data argument's name) for a model output with
    no negative entry that is 0 in ``rows`` where a data argument of its shape is positive."""
    pair = outputs_and_data(step, mb)
    if pair is None:
        return None
    outs, data = pair
    for j, out in enumerate(outs):
        if not isinstance(out, torch.Tensor) or not out.is_floating_point() \
                or out.dim() < 1 or max(rows) >= out.shape[0]:
            continue
        out = out.detach()
        if not bool(torch.isfinite(out).all()) or float(out.min()) < 0:
            continue
        idx = torch.tensor(rows, device=out.device)
        picked = out.index_select(0, idx)
        for name, t in data:
            if t.shape != out.shape:
                continue
            hit = (picked == 0) & (t.to(out.device).index_select(0, idx) > 0)
            if bool(hit.flatten(1).any(1).all()) if hit.dim() > 1 else bool(hit.all()):
                made = "the model's output" if len(outs) == 1 else f"the model's output {j}"
                return made, int(hit.sum()), name
    return None
