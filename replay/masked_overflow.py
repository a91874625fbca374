"""An overflow in a loss's entries that a mask's 0 then drops: padding.

A collate_fn that allocates the padded batch with ``torch.empty`` (or pads with a sentinel)
leaves the padded steps holding whatever the memory held; the loss computes every step, its
square overflows at a padded one, and ``(nll * mask).sum()`` multiplies that infinity by the
mask's 0, which is NaN. The op's own remedies (rescale, float64) miss the point: the values
are padding the loss never meant to use. The loss is re-run under a small dispatch mode that
goes on past the first non-finite value; when the op it first made is the origin and a
product then multiplied every non-finite value it met by a 0/1 mask's 0, the hint says so.
So for an infinity an op made at its pole (``invalid``): a negative binomial's ``log(mu)``
at a padded region whose expected cases are 0 (its population is 0), ``cases * log(mu)``
then 0 * -inf, and ``(ll * mask)`` NaN; the op's advice (an eps, or a constant the model wrote
as 0) is about entries the loss never meant to use. And for an infinity a rounding to 0 made
(``underflow``): an entropy bonus ``-(p * log(p)).sum(-1)`` of a confident decoder at a low
temperature, whose probabilities round to 0 only at the padded positions of a caption
``* keep`` then drops: the log-space advice stands, the mask is named beside it.
"""

from __future__ import annotations

from typing import Any

import torch

from .group_counts import PER_CLASS
from .label_branches import BRANCH, picks_branch
from .load import Step
from .masked_after import masked_in_loss
from .masked_product import mask_dropped
from .unfilled import UNFILLED
from .zero_coefficient import zero_coefficient


def _non_finite(leaves) -> bool:
    return any(isinstance(t, torch.Tensor) and t.is_floating_point()
               and not bool(torch.isfinite(t).all()) for t in leaves)


def masked_overflow_hint(report: dict[str, Any], step: Step) -> None:
    """Append to a loss's overflow the product that then masked it (see the docstring)."""
    o = report["origin"]
    if report.get("cause") not in ("overflow", "invalid", "underflow") \
            or o.get("phase") != "loss" \
            or (report.get("cause") == "invalid" and "mask's 0" in (report.get("hint") or "")) \
            or PER_CLASS in (report.get("hint") or "") \
            or o.get("module") != "<loss>" or o.get("made") not in ("+inf", "-inf") \
            or step.model is None or step.loss_fn is None or not report.get("hint"):
        return
    watch = masked_in_loss(step, o.get("micro_batch") or 0, _non_finite, mask_dropped)
    if watch is None or watch.masked is None or watch.first != (o.get("op"), o.get("source")):
        return
    op, source = watch.masked
    at = f" ({source})" if source else ""
    if picks_branch(watch.factors, watch.complemented):  # (a label: no padding, no mask)
        hint = _lead(report["hint"]) if UNFILLED in report["hint"] else report["hint"]
        report["hint"] = hint + BRANCH.format(op=op, at=at)
        return
    if zero_coefficient(watch.factors, step.loss_fn):
        return  # (a number or 0-d factor of 0, a distillation's T * T at T = 0: no mask)
    if report["cause"] == "invalid":  # (an op at its pole; a mask's product already said)
        # (the masked entries' 0 is no unfilled slot to look for: that advice is replaced)
        hint = _lead(report["hint"]) if UNFILLED in report["hint"] else report["hint"]
        report["hint"] = (
            f"{hint}. But every non-finite value it led to was then multiplied by a mask's 0 "
            f"in {op}{at}: the pole is hit in entries the loss leaves out (a padded "
            "region or sequence, an ignored target), and inf * 0 is NaN; make the op's input "
            "safe where the mask is 0 (torch.where(mask, x, 1) before it) or select the kept "
            "entries before the op (x[mask.bool()])")
        return
    if report["cause"] == "underflow":
        report["hint"] = report["hint"].rstrip(".") + _UNDERFLOW.format(op=op, at=at)
        return
    report["hint"] = (
        f"{report['hint']}. But every non-finite value it led to was then multiplied by a "
        f"mask's 0 in {op}{at}: the overflow is in entries the loss leaves out (padded steps, "
        "ignored targets), and inf * 0 is NaN. Check what the padding holds (a collate_fn's "
        "torch.empty or a sentinel pad value leaves huge values there): pad with 0 "
        "(torch.zeros, pad_sequence), or keep the masked entries out of the op "
        "(torch.where(mask, x, 0) before it, or x[mask.bool()])")


# a value rounded to 0 only in entries a mask then drops (padded positions)
_UNDERFLOW = (
    ". Every non-finite value it led to was then multiplied by a mask's 0 in {op}{at}: the "
    "0 is reached only in entries the loss leaves out (padded positions, ignored targets), "
    "and inf * 0 is NaN, so the mask cannot drop them; the log-space form is finite there, "
    "or select the kept entries before the op (x[mask.bool()])")


def _lead(hint: str) -> str:
    """What the hint says the op did (``aten.log of 0 (log has a pole at 0: -inf)``): its text
    up to the first colon or ", which" outside parentheses, where its advice begins."""
    depth = 0
    for i, c in enumerate(hint):
        depth += (c == "(") - (c == ")")
        if depth == 0 and (c == ":" or hint.startswith(", which", i)):
            return hint[:i]
    return hint
