"""Buffers the step's own forward wrote in place from the batch, and a division by a value made
of one of them.

A module that keeps a running statistic updates it itself, in its forward under ``no_grad``,
outside ``optimizer.step()``: vector-quantize-pytorch's EMA codebook lerps ``cluster_size``
and ``embed_avg`` toward the batch's assignment counts and summed vectors (or sets them from
k-means over the first batch's vectors) and then writes ``embed = embed_avg / cluster_size``
into its codebook; a running class histogram or prototype mean does the same. Such a buffer
is no setting the model was built with nor a parametrisation the optimizer trained: its
entries are 0 where no vector of the batch fell in a category (a code no vector chose, a
cluster k-means left empty), and the sum divided there is 0 too. The op finder keeps the
names of the buffers an in-place op wrote from values not made of the weights alone; the hint
of a division whose divisor was made of one of them says so, instead of the advice for a
statistic fitted where the model was built or a parametrisation.
"""

from __future__ import annotations

import torch

from .compat import writes_arguments

__all__ = ["BatchWritten", "written_divisor_hint"]


class BatchWritten:
    """The names of the buffers the forward wrote in place from the batch, in order."""

    def __init__(self):
        self.names: list[str] = []

    def track(self, func, name: str, args: tuple, weights_only: bool, names) -> None:
        """Note the buffer (named by ``names``, a :class:`~replay.param_names.ParamNames`) an
        in-place op (``copy_``, ``lerp_``, ``add_``) wrote, when what it wrote was not made of
        the weights alone."""
        if weights_only or func is None or not name.endswith("_") or not args \
                or not isinstance(args[0], torch.Tensor) or not writes_arguments(func):
            return
        if (buf := names.buffer_at(args[0])) is not None and buf not in self.names:
            self.names.append(buf)


def written_divisor_hint(op: str, ev, name: str | None, written: list[str],
                         divisor: torch.Tensor | None) -> str | None:
    """The hint of division ``op`` (its evidence ``ev``) whose divisor was made of buffer
    ``name`` alone, when the forward wrote that buffer in place from the batch (``written``:
    :attr:`BatchWritten.names`) before it; None otherwise."""
    if name is None or name not in written or len(ev.inputs) < 2 \
            or divisor is None or divisor.numel() < 2:  # (a per-category count: a scalar
        return None  # running statistic, TGN's time-gap std, keeps the divisor hints' eps)
    num, den = ev.inputs[0], ev.inputs[1]
    try:
        both = bool(((num == 0) & (den == 0)).any())
    except RuntimeError:  # (shapes that do not broadcast: a value taken at the bad entries)
        both = False
    what = "0 by 0 (0/0)" if both else "x by 0 (x/0)"
    at = f" at {int((divisor == 0).sum())} of its {divisor.numel()} entries"
    others = [n for n in written if n != name]
    also = f" (as it wrote {', '.join(others)})" if others else ""
    zero_sum = ", and the sum divided by it is 0 too" if both else ""
    return (f"{op} of {what}: the divisor was made of the buffer {name}, which this step's "
            f"forward wrote in place from the batch before dividing{also}: a running "
            "statistic the module updates itself, under no_grad, outside optimizer.step() (an "
            "EMA codebook's cluster sizes and summed vectors, set by k-means at its first "
            f"batch; a running class histogram), and it is 0{at}. A count is 0 for a category "
            "no vector of the batch fell in (a code no vector chose, a cluster k-means left "
            f"empty){zero_sum}. Every sample meets the same entries, so no record "
            "is to blame. Smooth the count before dividing by it (Laplace smoothing, (n + eps) "
            "/ (N + K * eps) * N with eps > 0: vector-quantize-pytorch's eps, which 0 turns "
            "off), floor it (n.clamp_min(eps)), or keep the old value where it is 0; and "
            "replace such dead codes (threshold_ema_dead_code)")
