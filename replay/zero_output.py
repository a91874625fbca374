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
from .perfect_fit import loss_pole, output_data_pairs

# (the pole texts of replay.domains: "by 0 (x/0, a pole)", "of 0 (a pole: 1/0)", log's)
_AT_ZERO = ("by 0 (", "of 0 (")


def zero_output_hint(report: dict[str, Any], step: Step) -> None:
    """Append to a loss origin's pole at 0 the model output's exact zeros under positive data."""
    hint, gate = report.get("hint") or "", loss_pole(report, step, _AT_ZERO)
    if gate is None or not gate[1] or "perfect fit" in hint or "the spread of" in hint:
        return
    mb, rows = gate
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
    idx = torch.tensor(rows)
    for made, out, name, t in output_data_pairs(step, mb):
        if out.dim() < 1 or max(rows) >= out.shape[0] or not bool(torch.isfinite(out).all()) \
                or float(out.min()) < 0:
            continue
        i = idx.to(out.device)
        hit = (out.index_select(0, i) == 0) & (t.index_select(0, i) > 0)
        if bool(hit.flatten(1).any(1).all()) if hit.dim() > 1 else bool(hit.all()):
            return made, int(hit.sum()), name
    return None
