"""A literal -inf fill (a mask) whose sign an op after it flipped before the output.

``-d.masked_fill(m, -inf)`` is ``-(d.masked_fill(m, -inf))``: the unary minus binds after the
method call, so the masked logits leave the model as +inf, which no loss reads as a mask (a
softmax's normaliser is then +inf, its loss inf or NaN). The report called it an intended
mask and advised ``allow_inf``, which only moves the event into the loss. :func:`negated`
tells it by the kind the module call returned: the opposite infinity of the one filled.
"""

from __future__ import annotations

__all__ = ["negated", "negated_hint"]

_OPPOSITE = {"-inf": "+inf", "+inf": "-inf"}


def negated(filled: str | None, returned: str | None) -> bool:
    """Whether the call returned (``returned``, the kind its output held: +inf wins over
    -inf) the opposite infinity of the one its only non-finite op filled."""
    return filled in _OPPOSITE and returned == _OPPOSITE[filled]


def negated_hint(op: str, filled: str) -> str:
    sign = filled.removeprefix("-").removeprefix("+")
    flipped = _OPPOSITE[filled]
    return (f"{op} filled a literal {filled} (a mask), but the output holds {flipped}: an op "
            f"after the fill flipped its sign (a minus or a negative factor applied to the "
            f"filled value: -d.masked_fill(m, -{sign}) is -(d.masked_fill(m, -{sign}))), so "
            f"the masked entries are {flipped}, which no loss reads as masked (a softmax over "
            f"them is inf or NaN); fill after negating, (-d).masked_fill(m, -{sign}), rather "
            "than allowing the infinity")
