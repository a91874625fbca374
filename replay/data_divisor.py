"""A loss's quotient of a learned value by a divisor made of the batch's data alone, 0 in
some samples' rows.

OpenAI's normalised MSE of a sparse autoencoder, ``((x_hat - x) ** 2).mean(1) /
(x ** 2).mean(1)``, divides each row's error by its input's own scale: an all-zero input row
(an activation buffer's row a short refill never wrote, padding) makes it ``x / 0``. The
dividend is learned, so the op is not "of the data alone" (:mod:`replay.lineage`) and the
hint said to add an eps to the denominator; but the divisor is the record's, and an eps would
weight that record's error by ``1 / eps``. :func:`marked` tells the op finder's evidence so,
and :data:`ADVICE` is what the hint adds.
"""

from __future__ import annotations

import torch

_DIVIDES = {"div", "true_divide", "divide"}

ADVICE = (
    "; but its divisor there was computed from the batch's data alone (a loss argument: "
    "nothing the model learns reaches it) and is exactly 0 at the samples named, so their "
    "records are degenerate for this loss (an all-zero row: an activation buffer's row never "
    "filled, padding, a blank input; a constant row under a variance), and an eps would "
    "weight their error by 1/eps: drop or repair such records where the data is made (the "
    "dataset, the buffer, the collate_fn) or leave them out of the loss (a mask of "
    "divisor > 0)")


def marked(lineage, op: str, ins: list[torch.Tensor], rows: list[int] | None,
           size: int) -> bool:
    """``op`` divided a learned non-zero value by a tensor made of the data alone, 0 in some
    of the batch's ``size`` samples (``rows``): the data's divisor, not the dividend, is to
    blame."""
    if lineage is None or not rows or len(rows) >= size or len(ins) != 2 \
            or op.removeprefix("aten.").split(".")[0].rstrip("_") not in _DIVIDES:
        return False
    if not (lineage.of_data(ins[1:]) and not lineage.of_data(ins[:1])):
        return False
    # x / 0 of a non-zero x (+-Inf): an eps would make the error 1/eps. A 0/0 where the dividend
    # is 0 too (a prototype's sum over no support sample by its count) is an empty group that
    # an eps or a count floor turns into 0: the usual advice stands there
    num, den = ins
    try:
        return bool(((den == 0) & (num != 0)).any())
    except RuntimeError:  # (shapes that do not broadcast: say nothing)
        return False
