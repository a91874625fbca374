"""A batch of matrices all 0 in every sample that a decomposition failed on: the model's.

:func:`replay.failed_samples.all_zero_hint` reads a matrix of zeros as a record with nothing in
it (a user with no ratings); that holds for some samples of a batch, not for every one. A
matrix of zeros in each sample comes from values 0 for any input: a regressor head that
predicts the matrix, zero-initialised where the identity was meant (an affine pre-alignment's
``Linear(., 12)`` with weight and bias 0, inverted for an inverse-consistent term). The hint
names the model's parameters all 0 as the step began.
"""

from __future__ import annotations

import torch
from torch import nn


def zero_everywhere_hint(op: str, model: nn.Module | None, rows: list[int],
                         size: int | None) -> str | None:
    """The hint when every one of the batch's ``size`` (more than 1) samples failed on a
    matrix of zeros; None when some samples did not fail."""
    if model is None or not size or size < 2 or sorted(rows) != list(range(size)):
        return None
    with torch.no_grad():
        zero = [n for n, p in model.named_parameters()
                if p.is_floating_point() and p.numel() and not bool(p.any())]
    named = (f": {', '.join(zero[:4])}{' and more' if len(zero) > 4 else ''} "
             f"{'is' if len(zero) == 1 else 'are'} all 0 as the step began") if zero else ""
    return (f"aten.{op}: the matrix is all zeros in every sample of the batch, in float64 too, "
            "so no record made it so: the values it is built from are 0 whatever the input, "
            f"a layer of the model's that outputs 0{named} (a zero-initialised head that "
            "predicts a matrix: start a transform, an affine matrix or a covariance factor at "
            "the identity, its bias eye(n) and its weight 0 or small random values), or add a "
            "ridge to the diagonal (A + eps * I)")
