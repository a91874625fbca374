"""What a backward origin at ``hypot``'s pole adds to the cause's hint.

``torch.hypot(re, im)``, a complex modulus written with the real and imaginary parts apart (a
radar cube's calibrated antennas stacked as channels, an I/Q pair), is finite where both parts
are 0, but its derivative ``re / hypot(re, im)`` is 0/0 there: a zero-padded antenna or
channel, a nulled bin, two coinciding points. The generic hint names sqrt, norms, logs and
divisions; this one says which input makes it and which spellings have a gradient of 0 there.
"""

from __future__ import annotations

HYPOT_POLE = (
    "; hypot(a, b) is 0 where both arguments are exactly 0 (a zero-padded antenna or channel, "
    "a nulled bin, a real/imag pair of a zero sample, two coinciding points) and its "
    "derivative a / hypot(a, b) is 0/0 there: take the modulus as torch.complex(a, b).abs() "
    "or torch.linalg.vector_norm(torch.stack([a, b], -1), dim=-1), whose gradient at 0 is 0, "
    "or drop the padded entries before the op")


def hypot_hint(node: str | None, saved_zero: str | None, hint: str) -> str:
    """``hint`` of a backward origin at node ``node``, with :data:`HYPOT_POLE` when the node is
    hypot's backward and it saved an exact 0 (its result, the derivative's pole)."""
    if not (node or "").startswith("HypotBackward") or saved_zero != "0" or HYPOT_POLE in hint:
        return hint
    return hint + HYPOT_POLE
