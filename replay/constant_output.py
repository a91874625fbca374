"""A loss's pole at 0 where the model's output is constant within each sample the origin names,
while the data it is compared with varies there: the 0 is the output's spread. A correlation
loss, ``1 - pearson_corrcoef(pred.T, target.T)`` over each series' horizon, of a persistence
forecaster at initialisation (the last value repeated, its correction's head at 0):
torchmetrics scales the variance by ``max_abs_dev ** -2``, inf at a spread of 0, and
``0 * inf`` is NaN; a z-score or cosine of the row has the same pole. The op's advice (a count
or degree clamped, an eps) does not say that the prediction is flat; the hint does. Not where the 0 is the output's own value (``replay.negative_output`` named
it: a variance head's ReLU at 0 under ``GaussianNLLLoss(eps=0)``'s log), flat because its
row is all 0."""

from __future__ import annotations

from typing import Any

import torch

from .load import Step
from .negative_output import ZEROS_MADE
from .perfect_fit import loss_pole, output_data_pairs

# (the pole texts of replay.domains: "of 0 (a pole: 1/0)", "by 0 (x/0, a pole)", a pow's)
_AT_ZERO = ("of 0 (", "by 0 (", "of 0 by 0", "of 0 to a negative power")


def constant_output_hint(report: dict[str, Any], step: Step) -> None:
    """Append to a loss origin's pole at 0 the samples whose model output is constant."""
    hint, gate = report.get("hint") or "", loss_pole(report, step, _AT_ZERO)
    if gate is None or not gate[1] or "perfect fit" in hint or ZEROS_MADE in hint:
        return  # (a 0 that is the output's own value, a ReLU head's: no spread of it)
    mb, rows = gate
    made = _flat_output(step, mb, rows)
    if made is None:
        return
    report["hint"] = (
        f"{hint}; that 0 is the spread of {made}: it is constant within each of samples "
        f"{rows} (every entry of the sample's row equal: a persistence forecast, a head "
        "initialised to 0, an output collapsed to its mean) while the data it is compared "
        "with varies there, and a statistic normalised by the prediction's spread "
        "(pearson_corrcoef, concordance_corrcoef, a cosine or a z-score of the row) is 0/0 "
        "or 0 * inf at a flat prediction: add an eps to that spread, or weigh the term in "
        "only once the prediction varies (an mse warm-up); the data is not to blame")


def _flat_output(step: Step, mb: int, rows: list[int]) -> str | None:
    """The name of a model output constant along every dimension after the first in each of
    ``rows``, beside a data argument of its shape that is not constant in any of them."""
    idx = torch.tensor(rows)
    for made, out, _name, t in output_data_pairs(step, mb):
        if out.dim() < 2 or out[0].numel() < 2 or max(rows) >= out.shape[0]:
            continue
        picked = out.index_select(0, idx.to(out.device)).flatten(1)
        d = t.index_select(0, idx.to(out.device)).flatten(1)
        if bool((picked == picked[:, :1]).all()) and bool((d != d[:, :1]).any(1).all()):
            return made
    return None
