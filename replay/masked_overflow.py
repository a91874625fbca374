"""An overflow in a loss's entries that a mask's 0 then drops: padding.

A collate_fn that allocates the padded batch with ``torch.empty`` (or pads with a sentinel)
leaves the padded steps holding whatever the memory held; the loss computes every step, its
square overflows at a padded one, and ``(nll * mask).sum()`` multiplies that infinity by the
mask's 0, which is NaN. The op's own remedies (rescale, float64) miss the point: the values
are padding the loss never meant to use. The loss is re-run under a small dispatch mode that
goes on past the first non-finite value; when the op it first made is the origin and a
product then multiplied every non-finite value it met by a 0/1 mask's 0, the hint says so.
"""

from __future__ import annotations

from typing import Any

import torch

from .load import Step
from .masked_after import masked_in_loss
from .masked_product import mask_dropped


def _non_finite(leaves) -> bool:
    return any(isinstance(t, torch.Tensor) and t.is_floating_point()
               and not bool(torch.isfinite(t).all()) for t in leaves)


def masked_overflow_hint(report: dict[str, Any], step: Step) -> None:
    """Append to a loss's overflow the product that then masked it (see the docstring)."""
    o = report["origin"]
    if report.get("cause") != "overflow" or o.get("phase") != "loss" \
            or o.get("module") != "<loss>" or o.get("made") not in ("+inf", "-inf") \
            or step.model is None or step.loss_fn is None or not report.get("hint"):
        return
    watch = masked_in_loss(step, o.get("micro_batch") or 0, _non_finite, mask_dropped)
    if watch is None or watch.masked is None or watch.first != (o.get("op"), o.get("source")):
        return
    op, source = watch.masked
    at = f" ({source})" if source else ""
    report["hint"] = (
        f"{report['hint']}. But every non-finite value it led to was then multiplied by a "
        f"mask's 0 in {op}{at}: the overflow is in entries the loss leaves out (padded steps, "
        "ignored targets), and inf * 0 is NaN. Check what the padding holds (a collate_fn's "
        "torch.empty or a sentinel pad value leaves huge values there): pad with 0 "
        "(torch.zeros, pad_sequence), or keep the masked entries out of the op "
        "(torch.where(mask, x, 0) before it, or x[mask.bool()])")
