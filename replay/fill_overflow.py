"""An overflow whose input holds the type's largest finite value itself: a mask's fill, not a
value that grew.

Attention code masks with the most negative finite number of the scores' type,
``sim.masked_fill(~mask, -torch.finfo(sim.dtype).max)`` (x-transformers, Hugging Face), so the
softmax of a row gives masked positions exactly 0 while a row whose every position is masked
(a query with no valid key: left padding under a causal mask, an empty sequence) stays finite.
But a max or logsumexp of such a row returns the fill itself, and any arithmetic on it that
grows it overflows: x-transformers' attention z-loss (``add_attn_z_loss=True``) sums the
layers' ``logsumexp`` of every attention row and squares it, padding rows included. The
overflow advice for a value too big for its type (rescale, a wider type) and the iteration
advice for an op whose earlier calls grew (:mod:`replay.upstream`) both miss that the number
is a literal edge of the type, written there on purpose.
"""

from __future__ import annotations

import torch

from .domains import g_pair

__all__ = ["fill_value", "fill_hint", "is_fill"]


def fill_value(ev) -> float | None:
    """The type's largest finite magnitude (signed) where an input of the overflowed op
    (``ev``: :class:`~replay.hits.Evidence`) holds it exactly, else None."""
    for v, dt in zip(ev.inputs, ev.input_dtypes):
        if not v.is_floating_point() or not v.numel() or not dt.is_floating_point:
            continue
        top = float(torch.finfo(dt).max)
        at = v.abs() == top
        if bool(at.any()):
            return float(v[at].flatten()[0])
    return None


def is_fill(size: float, dtype: torch.dtype) -> bool:
    """Whether an op's largest magnitude ``size`` is ``dtype``'s largest finite value."""
    return dtype.is_floating_point and size == float(torch.finfo(dtype).max)


def fill_hint(op: str, ev) -> str | None:
    """The overflow hint of an op that took its type's largest finite value (a mask's fill),
    else None."""
    value = fill_value(ev)
    if value is None:
        return None
    dt = str(ev.dtype).removeprefix("torch.")
    big = float(ev.local64.abs().max()) if ev.local64 is not None and ev.local64.numel() \
        else float("inf")
    big_s, top_s = g_pair(big, abs(value))
    sign = "-" if value < 0 else ""
    return (f"{op} took {sign}{top_s}, the largest finite value of its type itself, which "
            f"code writes as a mask's fill (masked_fill(~mask, {sign}torch.finfo(dtype).max): "
            "x-transformers' and Hugging Face's attention; or as nan_to_num's stand-in for an "
            "infinity), and its true result (up to "
            f"{big_s}) is beyond {dt}: a row whose every position was masked (a query with no "
            "valid key: left padding under a causal mask, an empty sequence) keeps the fill "
            "through a max or logsumexp, and adding or squaring it overflows (x-transformers' "
            "attention z-loss, add_attn_z_loss=True, squares the sum of the layers' "
            "logsumexp of every attention row, the padding rows' too); a wider type does not "
            "help, the fill is its edge too: leave fully masked rows out of that arithmetic "
            "(mask them out of the reduction, right-pad so every query has a valid key), or "
            "fill with a number far from the type's edge (torch.finfo(dtype).min / 2 for a "
            "sum of two, -1e4 for a square)")
