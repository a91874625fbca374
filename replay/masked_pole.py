"""A backward node that multiplied an infinity its forward op made at a pole, which the
forward then masked out (``torch.where(d > 0, 1 / d, d)``, a row sum 0 at a vertex): the
maker's own cause text advises an eps or skipping the rows where the input is 0, and skipping
them with torch.where after the op is what the code did. Whether exact arithmetic puts the
input on the pole too, only rounding does, or an underflow (a masked action's probability,
exp of its -1e10 fill, whose log an entropy ``(p * p.log()).masked_fill(~avail, 0)`` took),
the fix is a safe input before the op. So too for
a NaN the op made outside its domain from finite inputs that a pointwise op saved (a spline's
root ``sqrt(b² - 4ac)`` run on the tails, times a coefficient, then ``torch.where(inside, x,
y)``): it passed that NaN on, and only a mask after it can have dropped it; not one a fused
kernel saved and dropped itself (CPU's flash attention returns 0 for a row of NaN scores)."""

from __future__ import annotations

import re

import torch

from . import domains
from .cause_text import DO


def with_masked_pole(hint: str, op: str, made: str, cause: str, node: str = "") -> str:
    """``hint`` for a saved infinity ``made`` by forward ``op`` (``"aten.reciprocal"``) whose
    cause is ``cause``, with the masked-branch advice when the op made it at its pole (or a
    NaN outside its domain that backward node ``node``, a pointwise op's, saved)."""
    name = op.rpartition(".")[2].strip("_")
    # (an underflow too: log of a softmax's exact 0 where a mask filled the logit, -1e10,
    # multiplied by that 0 and masked_fill'ed after: an entropy over the allowed actions)
    at_pole = made in ("+inf", "-inf") and cause in ("invalid", "precision", "underflow")
    outside = made == "nan" and cause == "invalid" and _pointwise(node)
    if not (outside or at_pole and not domains.never_a_pole(name)) or "both branches" in hint:
        return hint
    return f"{hint}; {DO['masked']}"


def _pointwise(node: str) -> bool:
    """Backward node ``node`` (``"MulBackward0"``) is a pointwise aten op's, which passes a NaN
    on: no saturation carries one, so a mask after it dropped it."""
    snake = re.sub(r"(?<!^)(?=[A-Z])", "_", node.partition("Backward")[0]).lower()
    packet = getattr(torch.ops.aten, snake, None)
    try:
        return packet is not None and any(torch.Tag.pointwise in getattr(packet, o).tags
                                          for o in packet.overloads())
    except Exception:  # (no such overloads: not an aten op's node)
        return False
