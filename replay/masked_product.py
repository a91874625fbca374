"""A mask applied by multiplication to a NaN: ``(nll * observed).sum()``, ``x.abs() * mask``.

Missing values stored as NaN (a forecasting target with gaps, a series under ``allow_nan``)
are meant to be left out by a 0/1 mask, but ``NaN * 0`` is NaN: the mask keeps every missing
value it was meant to drop. When such a NaN is what the step's event names, the first product
that met a NaN with a factor of exactly 0 at the same position is where the code meant to
drop it; the hint names that op and its line (``replay.ops`` watches for it, this module says
whether an op is one; ``replay.masked_targets`` re-runs a loss to find it).
"""

from __future__ import annotations

import torch

from recorder.finite import zero_one

from . import xlogx
from .cause_text import MASKED_BY_PRODUCT

# products elementwise, in and out of place (a bool mask is promoted to the NaN's dtype)
_PRODUCTS = {"mul", "mul_", "multiply", "multiply_"}


def nan_times_zero(name: str, args) -> bool:
    """Whether aten op ``name`` on ``args`` multiplied NaN by a factor of exactly 0 (a
    tensor or a number, boolean or not), at every NaN position."""
    if name not in _PRODUCTS or len(args) < 2:
        return False
    a, b = args[0], args[1]
    with torch.no_grad():
        try:
            return bool(_met(a, b) or _met(b, a))
        except RuntimeError:  # shapes that do not broadcast: the op would have raised
            return False


def nan_times_mask(name: str, args) -> bool:
    """:func:`nan_times_zero` where the 0 is a 0/1 mask's, not data's own 0 (a padded
    record's time since dose of 0 in ``exp(-k * t)``)."""
    if name not in _PRODUCTS or len(args) < 2:
        return False
    a, b = args[0], args[1]
    with torch.no_grad():
        try:
            return bool((_met(a, b) and _mask_like(b)) or (_met(b, a) and _mask_like(a)))
        except RuntimeError:  # shapes that do not broadcast: the op would have raised
            return False


def mask_dropped(name: str, args) -> bool:
    """Whether aten op ``name`` multiplied every non-finite value of one operand by a 0/1
    mask's exact 0 (padding's ``nll * mask`` after the padded entries overflowed)."""
    if name not in _PRODUCTS or len(args) < 2:
        return False
    a, b = args[0], args[1]
    with torch.no_grad():
        try:
            return bool((_met(a, b, _bad) and _mask_like(b)) or (_met(b, a, _bad) and _mask_like(a)))
        except RuntimeError:  # shapes that do not broadcast: the op would have raised
            return False


def _bad(x: torch.Tensor) -> torch.Tensor:
    return ~torch.isfinite(x)


def mask_after_pole(first, name: str, args, hit, lineage=None) -> None:
    """When the first NaN (``hit``, of op ``name`` on ``args``) is a product of an infinity
    by a mask's exact 0, and the op blamed (``first``) made that infinity at a pole
    (``1 / gt`` of a depth map's holes, masked by ``* valid`` after the division), note the
    product on ``first``'s evidence: the mask came after the pole, where ``inf * 0`` is NaN."""
    ev = first.evidence if first is not None else None
    if ev is None or first.made not in ("+inf", "-inf") or name not in _PRODUCTS \
            or len(args) < 2 or _numbers(args[:2]):
        return
    with torch.no_grad():
        try:
            met = (_met(args[0], args[1], torch.isinf) and _mask_like(args[1], lineage)) or (
                _met(args[1], args[0], torch.isinf) and _mask_like(args[0], lineage))
        except RuntimeError:
            return
    if met:
        ev.masked_after = f"{hit.op}" + (f" ({hit.source})" if hit.source else "")
    else:
        xlogx.note(first, args, hit, _met, lineage)


def _numbers(args) -> bool:
    """Both factors one number each (``L * log(L)`` of a setting of 0): no entries for a mask
    to select, and the infinity may be another op's than the pole blamed."""
    return all(not isinstance(a, torch.Tensor) or a.numel() == 1 for a in args)


def _mask_like(factor, lineage=None) -> bool:
    """A 0/1 mask (bool, or every element 0 or 1), not data that is 0 where the pole's input
    is: RMSNorm's ``x * rsqrt(mean(x²))`` of an all-zero row multiplies the infinity by x's
    own 0, and the fix is the pole's eps, not masking earlier. A float factor of 0 everywhere
    drops nothing in particular: it is a zero state (an LSTM cell written out, ``sigmoid(f) *
    c`` at its first step's ``c = zeros``, met by NaN gates), not a mask; unless a comparison
    made it (CROWN's ``unstable = ((l < 0) & (u > 0)).float()``, nothing unstable at eps 0)."""
    if not isinstance(factor, torch.Tensor):
        return True  # (a number, 0 there)
    if factor.dtype == torch.bool:
        return True
    return zero_one(factor) and (factor.numel() == 1 or bool(factor.any()) or (
        lineage is not None and lineage.counts.compared(factor)))


def _met(x, factor, bad=torch.isnan) -> bool:
    """The factor is 0 wherever ``x`` is bad: a mask meant to drop those values. (A window
    multiplied into frames of NaN, stft's Hann window with its one 0, drops nothing.)"""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        return False
    nan = bad(x)
    if not bool(nan.any()):
        return False
    if not isinstance(factor, torch.Tensor):
        return factor == 0
    zero, nan = torch.broadcast_tensors(factor == 0, nan)
    return bool(zero[nan].all())


# the product's 0 is no 0/1 mask's but a weight's own (an alpha of 0 on a foreground left NaN
# where it is 0): "a mask's 0" would send the user looking for a mask that is not there
_WEIGHTED_BY_ZERO = (
    "{op}{at} multiplied the NaN of {tensor} (rows {rows}) by an exact 0 of its other factor, "
    "no 0/1 mask but a weight that is 0 there (an alpha, a mixing or attention weight), and "
    "NaN * 0 is NaN: a term weighted by 0 still carries the NaN. The data holds NaN where that "
    "weight is 0 (values left undefined there: a foreground divided by an alpha of 0 when the "
    "data was made); make them finite where the data is made (torch.where(alpha > 0, x, 0)) "
    "or before the first op that reads them (torch.nan_to_num(x))")


# the same product, the NaN in a tensor with no sample's rows (a weight per class, a scale):
# no record's value left undefined, but a NaN computed into the weight itself
_WEIGHT_NAN = (
    "{op}{at} multiplied the NaN of {tensor}, which holds no sample's rows (a weight per class "
    "or a constant the loop computed and passed), by an exact 0 of its other factor, and NaN "
    "* 0 is NaN: the NaN is in {tensor} itself, made where the loop computed it, before the "
    "loss")


def masked_hint(origin: dict, hit, by_mask: bool = True) -> str:
    """The hint for ``origin``'s NaN that product ``hit`` (an OpHit, or (op, source)) kept,
    multiplying it by a 0/1 mask's 0 (``by_mask``) or by another factor's own 0; ``origin``
    is given the product's line as its source."""
    op, source = (hit.op, hit.source) if hasattr(hit, "op") else hit
    origin["source"] = origin.get("source") or source
    at = f" ({source})" if source else ""
    tensor, rows = origin.get("tensor"), origin.get("samples")
    if not by_mask and not rows:
        return _WEIGHT_NAN.format(op=op, at=at, tensor=tensor)
    text = MASKED_BY_PRODUCT if by_mask else _WEIGHTED_BY_ZERO
    return text.format(op=op, at=at, tensor=tensor, rows=rows)


def masked_row_product_hint(hint: str | None, finder, hit) -> str | None:
    """``hint``, with the product that then multiplied the NaN of a fully masked row by a
    mask's 0 (padding steps' ``delta * pad`` after a ``log_softmax`` over a sink state with
    every action masked): the product keeps it, NaN * 0 being NaN."""
    kept = finder.masked_nan
    if hint is None or hit is None or kept is None or not hit.row_masked or hit.made != "nan" \
            or not finder.masked_by_mask:
        return hint
    at = f" ({kept.source})" if kept.source else ""
    return (f"{hint}; {kept.op}{at} then multiplied those NaN by a mask's 0 to drop them, "
            "which keeps them (NaN * 0 is NaN): drop them with torch.where(mask, x, 0) instead, "
            "and give each masked row one allowed entry (a padded step's terminal action): "
            "the gradient of an all -inf row is NaN too unless masked_fill made its -inf")
