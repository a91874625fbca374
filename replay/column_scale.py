"""An overflow of a run fed features in different units: one column of a ``(B, F)`` batch at a
scale far from the others'.

Tabular and causal-discovery data (a linear SEM's variables, NOTEARS' ``X``) has one variable
per column; a column logged in millimetres among metres is 1000x the others, the least-squares
gradient of the weights that multiply it is 1000x to 1e6x larger, and one plain SGD step throws
them out (``matrix_exp(W * W)`` then overflows). No row stands out (:mod:`replay.data_scale`
looks for records), every sample holds the column; the precursors see the weights jump and say
to lower the learning rate, which only slows the divergence the scale causes. The hint names
the columns and says to standardise them; not when a few records stand out from every other
row (:mod:`replay.data_scale` names them: one idle session's dwell makes its column wide too),
nor when the model keeps a statistic per column as wide there (a standardiser's std buffer).
An op on the batch's data alone that overflowed in the samples whose value of that column is
largest (float16 autocast's cast of an income in dollars) is said of the column too: its hint's
"those records hold values out of the scale of the rest" (``replay.batch_overflow``) is cut.
An underflow is said of such a column too: logits as far apart as the column is wide, whose
softmax rounded a probability to exactly 0 before the loss took its log (a Keras-style
``Softmax`` head fed a feature in square feet among z-scores).
"""

from __future__ import annotations

from typing import Any

import torch

from recorder.capture import batch_path

from .batch_overflow import said_of_data, without_advice
from .domains import g
from .load import Step
from .outliers import out_of_scale
from .recorded import n_args

_RATIO = 100.0  # a column this many times the median column's absmax is in another unit

# (an op on the batch's data alone, which overflowed in the records whose value of that column
# is largest: every record holds the column at its scale, none is out of the others')
DATA_ALONE = ("a variable in another unit than the rest (an income in dollars among z-scores), "
              "whose largest values pass the op's range in the samples named, while no record "
              "stands out of the others' scale in it; standardise the columns before fitting "
              "((x - mean) / std with the training set's statistics, log1p first for an "
              "amount spanning decades) rather than crop those records")


# (an underflow: logits as far apart as the column is wide, whose exp rounded to 0)
UNDERFLOW = ("variables in other units (square feet among z-scores) make the pre-activations "
             "that multiply them as much larger, so logits lie hundreds apart and their exp or "
             "softmax rounds to exactly 0; standardise the columns before fitting ((x - mean) "
             "/ std with the training set's statistics, log1p first for an amount spanning "
             "decades), beside taking the log in log space")


def _wide_columns(t: torch.Tensor) -> tuple[list[int], float, float] | None:
    """(columns, their absmax, the median column's absmax) of a 2-D float batch."""
    if t.dim() != 2 or not t.is_floating_point() or t.shape[1] < 3 or t.shape[0] < 2:
        return None
    a = t.detach().abs().double()
    amax = a.amax(0)
    if not bool(torch.isfinite(amax).all()):
        return None
    med = float(amax.median())
    # (and wide in its typical row: a column large in one record only, a timestamp in ms
    # among seconds in a (B, T) sequence, is that record's fault, not the column's unit)
    typical = a.median(0).values
    usual = float(typical.median())
    cols = [j for j, x in enumerate(amax.tolist()) if med > 0 and x >= _RATIO * med
            and (usual == 0 or float(typical[j]) >= _RATIO * usual)]
    return (cols, float(amax[cols].max()), med) if cols else None


def _kept_per_feature(step: Step, cols: list[int], n: int) -> bool:
    """A buffer of the model holds one statistic per column, as wide at ``cols`` (a
    standardiser's mean and std from the training set, a BatchNorm1d's running variance):
    the model rescales the columns itself before any weight multiplies them."""
    for key, b in step.tensors.items():
        if key.startswith("buffers/") and b.shape == (n,) and b.is_floating_point():
            a = b.detach().abs().double()
            med = float(a.median())
            if all(float(a[j]) >= 10 * med for j in cols):
                return True
    return False


def column_scale_hint(report: dict[str, Any], step: Step) -> None:
    """Append to an overflow's or underflow's hint the batch columns far above the others'
    scale."""
    o = report.get("origin") or {}
    if report.get("cause") not in ("overflow", "underflow") or not report.get("hint"):
        return
    if out_of_scale(step, o) is not None:  # (records that stand out made the column wide:
        return  # theirs is the fault, said by replay.data_scale; the column's unit is fine)
    i = o.get("micro_batch") or 0
    mb = step.micro_batches[i] if i < len(step.micro_batches) else {}
    for key, raw in (mb.get("paths") or {}).items():
        t = step.tensors.get(key)
        if isinstance(t, torch.Tensor) and (found := _wide_columns(t)) is not None:
            cols, big, med = found
            if _kept_per_feature(step, cols, t.shape[1]):
                return  # (the model standardises the columns itself: their unit is no fault)
            path = batch_path(raw, n_args(mb.get("inputs")))
            head = (f". But column(s) {', '.join(map(str, cols))} of {path} reach {g(big)} "
                    f"where the median column reaches {g(med)}: ")
            if report["cause"] == "underflow":
                report["hint"] = f"{report['hint']}{head}{UNDERFLOW}"
                return
            if said_of_data(report):  # (its records are no outliers: the column's unit is)
                report["hint"] = without_advice(report["hint"]) + head + DATA_ALONE
                return
            report["hint"] = (
                f"{report['hint']}{head}"
                "variables in other units (millimetres among metres) make the gradients of "
                "the weights that multiply them as much larger, so the updates throw those "
                "weights out; standardise the columns before fitting ((x - mean) / std, "
                "dropping constant ones), rather than only lowering the learning rate")
            return
