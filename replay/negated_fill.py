"""A literal -inf fill (a mask) whose sign an op after it flipped before the output.

``-d.masked_fill(m, -inf)`` is ``-(d.masked_fill(m, -inf))``: the unary minus binds after the
method call, so the masked logits leave the model as +inf, which no loss reads as a mask (a
softmax's normaliser is then +inf, its loss inf or NaN). The report called it an intended
mask and advised ``allow_inf``, which only moves the event into the loss. :func:`negated`
tells it by the kind the module call returned, +inf where the fill was -inf, and by the loss
the re-run made of that output: not finite (a model returning distances, ``-(s.masked_fill(m,
-inf))``, whose loss negates them back, means its +inf and keeps the allow_inf advice).
"""

from __future__ import annotations

__all__ = ["negated", "negated_hint"]


def negated(filled: str | None, returned: str | None, run, micro_batch: int) -> bool:
    """Whether the call returned +inf (``returned``, the kind its output held: +inf wins over
    -inf) where its only non-finite op filled -inf, and the re-run's loss of that
    micro-batch is not finite."""
    if (filled, returned) != ("-inf", "+inf") or micro_batch not in run.loss_micro_batches:
        return False
    return not run.loss_finite[run.loss_micro_batches.index(micro_batch)]


def negated_hint(op: str) -> str:
    return (f"{op} filled a literal -inf (a mask), but the output holds +inf and the loss is "
            "not finite: an op after the fill flipped its sign (a minus or a negative factor "
            "applied to the filled value: -d.masked_fill(m, -inf) is -(d.masked_fill(m, "
            "-inf))), so the masked entries are +inf, which no loss reads as masked (a "
            "softmax over them is inf or NaN); fill after negating, (-d).masked_fill(m, "
            "-inf), rather than allowing the infinity")
