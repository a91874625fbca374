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

__all__ = ["literals", "nan_given", "nan_number", "nan_number_hint"]

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
        return float(a.detach())  # (a value the loss computes: no autograd warning)
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


def nan_number(name: str, leaves: list) -> float | None:
    """NaN given to an op that does not fill with it as a plain number (a Python float, a
    numpy scalar: ``w - beta * np.log(-gamma / zeta)`` with ``gamma > 0``): made by Python or
    numpy code before the op, where no tensor op saw it; else None."""
    if name in _FILLS:
        return None
    return next((a for a in leaves if isinstance(a, float) and math.isnan(a)), None)


def nan_number_hint(op: str) -> str:
    return (f"{op} was given NaN as a number (a Python float or numpy scalar, not a tensor), "
            "so its tensor inputs were finite: the NaN was made before it by Python or numpy "
            "arithmetic on the source line (np.log or np.sqrt of a negative constant, which "
            "warns instead of raising as math.log does; 0/0 of numpy scalars; a "
            "float('nan') default). Check the constants that number is computed from (a "
            "sign or a range of a hyperparameter) and compute it with math, which raises")


def nan_given(hit) -> bool:
    """Was the op blamed (an ``OpHit``) given NaN as a number (see :func:`nan_number`)?"""
    return hit.literal is not None and math.isnan(hit.literal)
