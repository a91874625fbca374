"""A loss's quotient of a learned value by a divisor made of the batch's data alone, 0 in
some samples' rows.

OpenAI's normalised MSE of a sparse autoencoder, ``((x_hat - x) ** 2).mean(1) /
(x ** 2).mean(1)``, divides each row's error by its input's own scale: an all-zero input row
(an activation buffer's row a short refill never wrote, padding) makes it ``x / 0``. The
dividend is learned, so the op is not "of the data alone" (:mod:`replay.lineage`) and the
hint said to add an eps to the denominator; but the divisor is the record's, and an eps would
weight that record's error by ``1 / eps``. :func:`marked` tells the op finder's evidence so,
and :data:`ADVICE` is what the hint adds. So is an integer tensor's divisor (a count per
sample the batch carries, which nothing learned reaches): an RNN-T loss per label token,
``nll / y_lens``, over an utterance with an empty transcript.
"""

from __future__ import annotations

import torch

_DIVIDES = {"div", "true_divide", "divide"}

ADVICE = (
    "; but its divisor there was computed from the batch's data alone (a loss argument: "
    "nothing the model learns reaches it) and is exactly 0 at the samples named, so their "
    "records are degenerate for this loss (an all-zero row: an activation buffer's row never "
    "filled, padding, a blank input; a constant row under a variance; a length of 0: an empty "
    "transcript or sequence), and an eps would "
    "weight their error by 1/eps: drop or repair such records where the data is made (the "
    "dataset, the buffer, the collate_fn) or leave them out of the loss (a mask of "
    "divisor > 0)")


def marked(lineage, op: str, ins: list[torch.Tensor], rows: list[int] | None,
           size: int, leaves: list | None = None) -> bool:
    """``op`` divided a learned non-zero value by a tensor made of the data alone, or by an
    integer tensor (of the op's arguments ``leaves``), 0 in some of the batch's ``size``
    samples (``rows``): the data's divisor, not the dividend, is to blame."""
    if lineage is None or not rows or len(rows) >= size \
            or op.removeprefix("aten.").split(".")[0].rstrip("_") not in _DIVIDES:
        return False
    if len(ins) == 1 and (count := _count(leaves)) is not None:
        ins = [ins[0], count]  # (a count is never learned)
    elif len(ins) != 2 or not lineage.of_data(ins[1:]):
        return False
    if lineage.of_data(ins[:1]):
        return False
    # x / 0 of a non-zero x (+-Inf): an eps would make the error 1/eps. A 0/0 where the dividend
    # is 0 too (a prototype's sum over no support sample by its count) is an empty group that
    # an eps or a count floor turns into 0: the usual advice stands there
    num, den = ins
    try:
        return bool(((den == 0) & (num != 0)).any())
    except RuntimeError:  # (shapes that do not broadcast: say nothing)
        return False


def _count(leaves: list | None) -> torch.Tensor | None:
    """The divisor of a division's arguments when it is an integer tensor (lengths, counts)."""
    d = leaves[1] if leaves is not None and len(leaves) > 1 else None
    if isinstance(d, torch.Tensor) and d.dim() and not d.is_floating_point() \
            and not d.is_complex() and d.dtype != torch.bool:
        return d
    return None
