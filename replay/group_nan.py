"""A batch tensor of records by features ``(B, F)`` non-finite in one feature of some records,
finite elsewhere, where those records are exactly the batch's records of one group that
another feature names (a one-hot or code column equal to one value in them and to another
value in every other record): a value the data pipeline computed per group, not missing data
scattered at random. CTGAN's mode-specific normalisation ``(x - mu_k) / (4 * sigma_k)`` of a
zero-inflated column encodes the zeros in a mode whose values are all equal (``sigma_k`` = 0:
0/0 at exactly the records whose mode one-hot is 1); a per-category standardisation of a
category holding one repeated value does the same.
"""

from __future__ import annotations

import torch

GROUP_NAN = (
    "the batch itself holds {kind}, and {tensor} holds it in feature {col} (of {width}) of "
    "exactly the samples whose feature {group} is {value} ({count} of {total}: {rows}), "
    "finite everywhere else: a value the data pipeline computed per group (a mixture mode or "
    "a category that feature {group} marks), not values missing at random: a per-group "
    "standardisation (x - mu_g) / sigma_g whose group holds one repeated value (sigma_g = 0: "
    "a spike of equal values, a zero-inflated column's zeros, a mode of a column of a few "
    "discrete values) gives 0/0 or x/0 at every sample of that group; add an eps to the "
    "group's scale where the transform is fitted (sigma_g + eps, or a floor as a Gaussian "
    "mixture's reg_covar), or encode such a spike as a category of its own; if that group "
    "simply lacks the feature, fill it there (with a missing-indicator) before the model")

SHOWN = 8  # samples named


def _value(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:.4g}"


def group_nan(t: torch.Tensor | None, d: int | None, kind: str) -> str:
    """``GROUP_NAN`` filled for ``t`` when ``t`` is ``(B, F)`` with its samples in dim 0, its
    non-finite values all in one feature of at least 2 samples but not all, and another
    feature equal to one value at exactly those samples; else ""."""
    if t is None or d != 0 or t.dim() != 2 or t.shape[1] < 2 or not t.is_floating_point():
        return ""
    bad = ~torch.isfinite(t.detach())
    cols = bad.any(0).nonzero().flatten().tolist()
    rows = bad.any(1)
    count = int(rows.sum())
    if len(cols) != 1 or not 2 <= count < t.shape[0]:
        return ""
    first = int(rows.nonzero()[0, 0])
    for k in range(t.shape[1]):
        if k == cols[0] or not bool(torch.isfinite(t[:, k]).all()):
            continue
        same = t[:, k] == t[first, k]
        if bool(torch.equal(same, rows)):
            names = rows.nonzero().flatten().tolist()
            shown = ", ".join(map(str, names[:SHOWN])) + (", ..." if count > SHOWN else "")
            return GROUP_NAN.format(
                kind=kind, tensor="{tensor}", col=cols[0], width=t.shape[1], group=k,
                value=_value(float(t[first, k])), count=count, total=t.shape[0], rows=shown)
    return ""
