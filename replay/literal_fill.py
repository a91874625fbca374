"""An op's literal +-inf (or NaN fill) argument: a number the user wrote, an intended mask.

A float argument is one (``masked_fill(mask, -inf)``, ``full``). So is a 0-d tensor given as
the value of an indexed or masked write: ``x[mask] = float("-inf")`` reaches aten as
``index_put_`` of a 0-d tensor that ``lift_fresh`` made of the Python number (fairseq's
wav2vec 2.0 ``logits[1:][neg_is_pos] = float("-inf")``). That fill was taken for an op given
a non-finite input, never as the chain's intended start, and the report named an earlier
mask's ``masked_fill`` (the Transformer's key padding, consumed inside it) for the infinity
the model returned. A 0-d ±inf an earlier op of the step made from finite values is blamed
at that op, before it reaches such a write.
"""

from __future__ import annotations

import math

import torch

__all__ = ["literals"]

# Ops whose literal NaN argument is the value they write: padding marked for nanmean/nansum
# (``x.masked_fill(~mask, nan).nanmean(1)``), meant as a -inf mask is
_FILLS = {"masked_fill", "masked_fill_", "full", "full_like", "new_full", "fill", "fill_",
          "where", "index_fill", "index_fill_"}
# Ops that write a 0-d tensor's value where an index or mask says (past their first argument)
_TENSOR_VALUE = {"index_put", "index_put_", "_index_put_impl_", "masked_fill", "masked_fill_",
                 "index_fill", "index_fill_", "where", "fill", "fill_"}


def _value(name: str, a, first: bool) -> float | None:
    if isinstance(a, float):
        return a
    if not first and name in _TENSOR_VALUE and isinstance(a, torch.Tensor) and a.dim() == 0 \
            and a.is_floating_point() and not a.is_meta:
        return float(a)
    return None


def literals(name: str, leaves: list, ins: list) -> tuple[float | None, bool, list]:
    """The op's literal +-inf, whether it is a fill writing a literal NaN, and its floating
    inputs ``ins`` less a 0-d literal tensor (so an op whose only non-finite input is the
    literal it writes counts as given finite values, as ``masked_fill(mask, -inf)`` does)."""
    values = [(a, v) for i, a in enumerate(leaves) if (v := _value(name, a, i == 0)) is not None]
    inf = next((v for _, v in values if math.isinf(v)), None)
    filled = name in _FILLS and any(math.isnan(v) for _, v in values)
    lifted = [a for a, v in values if isinstance(a, torch.Tensor) and not math.isfinite(v)]
    return inf, filled, [t for t in ins if not any(t is a for a in lifted)]
