"""A softmax NaN in every sample, on rows that the attention module's own causal buffer masked
whole: the fill's condition is inverted.

nanoGPT and minGPT keep the causal mask as a buffer of ones on and below the diagonal
(``self.bias = torch.tril(torch.ones(L, L))``) and fill where it is 0:
``att.masked_fill(self.bias[:, :, :T, :T] == 0, float('-inf'))``. Written ``== 1`` (or with
``triu(ones)`` built to hold the future, its diagonal included) the fill masks every query's own
position and all on one side of it: the last (or first) query has no key left, in every sample
whatever the data. The fully-masked-row advice (keep a key per row, fill with a finite number)
is no fix there (a finite fill would hide it, a leak of the keys the mask is for): the mask
is built wrong, not padding. :func:`causal_buffer_hint` replaces that advice, naming the
buffer, when the origin's module takes no argument but its input (no padding mask), holds a
triangular 0/1 buffer whose diagonal is 1, and every sample of the batch is named.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from .load import Step

_MASKED_ROW = "(a fully masked row)"  # (replay.plus_inf_row's softmax of a row of -inf)
_SOFTMAX = {"aten._softmax", "aten.softmax", "aten._safe_softmax", "aten._log_softmax"}

__all__ = ["causal_buffer_hint"]


def causal_buffer_hint(report: dict[str, Any], step: Step) -> None:
    """Append the module's triangular buffer whose diagonal a fill of its 1s masks."""
    o, hint = report.get("origin") or {}, report.get("hint") or ""
    if report.get("cause") != "invalid" or _MASKED_ROW not in hint or not o.get("all_samples") \
            or o.get("op") not in _SOFTMAX or step.model is None or o.get("module") is None:
        return
    try:
        module = step.model.get_submodule(o["module"])
        alone = len(inspect.signature(module.forward).parameters) == 1
    except (AttributeError, TypeError, ValueError):
        return
    if not alone:  # (a mask argument beside: padding, replay.masked_whole's)
        return
    for name, buf in module.named_buffers(recurse=False):
        side = _triangle(buf)
        if side is None:
            continue
        first = "last" if side == "lower" else "first"
        head = hint[:hint.index(_MASKED_ROW) + len(_MASKED_ROW)]  # (the generic advice, a
        # finite fill, would hide it: that query would attend to every key it must not see)
        report["hint"] = (
            f"{head}: {o['module'] or '<root>'}.{name} is a causal mask of 1s on and "
            f"{'below' if side == 'lower' else 'above'} the diagonal, and every sample's rows "
            f"are masked whole: a fill where that buffer is 1 masks each query's own position "
            f"and its {'past' if side == 'lower' else 'future'}, which leaves the {first} "
            "query no key in any sample, whatever the data. The fill's condition is inverted: "
            f"fill where it is 0 (masked_fill(self.{name}[:, :, :T, :T] == 0, float('-inf')), "
            "as nanoGPT writes it), not where it is 1; a finite fill instead of -inf would "
            "hide it, the query then attending evenly to keys it must not see")
        return


def _triangle(buf: torch.Tensor) -> str | None:
    """``"lower"`` or ``"upper"`` for a 0/1 (or bool) buffer whose last two dims are a square
    triangle of 1s with the diagonal, its leading dims of size 1; else None."""
    if buf.dim() < 2 or buf.shape[-1] != buf.shape[-2] or buf.shape[-1] < 2 \
            or any(s != 1 for s in buf.shape[:-2]):
        return None
    sq = buf.reshape(buf.shape[-2:])
    if bool(((sq != 0) & (sq != 1)).any()):
        return None
    ones = torch.ones_like(sq, dtype=torch.bool)
    if torch.equal(sq.bool(), ones.tril()):
        return "lower"
    return "upper" if torch.equal(sq.bool(), ones.triu()) else None
