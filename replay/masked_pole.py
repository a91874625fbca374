"""A backward node that multiplied an infinity its forward op made at a pole, which the
forward then masked out (``torch.where(d > 0, 1 / d, d)``, a row sum 0 at a vertex): the
maker's own cause text advises an eps or skipping the rows where the input is 0, and skipping
them with torch.where after the op is what the code did. Whether exact arithmetic puts the
input on the pole too or only rounding does, the fix is a safe input before the op. So too for
a NaN the op made outside its domain from finite inputs, which only a mask can have dropped (a
spline's root ``sqrt(b² - 4ac)`` run on the tails, then ``torch.where(inside, x, y)``)."""

from __future__ import annotations

from . import domains
from .cause_text import DO


def with_masked_pole(hint: str, op: str, made: str, cause: str) -> str:
    """``hint`` for a saved infinity ``made`` by forward ``op`` (``"aten.reciprocal"``) whose
    cause is ``cause``, with the masked-branch advice when the op made it at its pole."""
    name = op.rpartition(".")[2].strip("_")
    at_pole = made in ("+inf", "-inf") and cause in ("invalid", "precision")
    outside = made == "nan" and cause == "invalid"  # (no saturation carries a NaN: a mask)
    if not (outside or at_pole and not domains.never_a_pole(name)) or "both branches" in hint:
        return hint
    return f"{hint}; {DO['masked']}"
