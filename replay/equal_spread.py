"""A division by a spread (std, variance, range) of values that a state all 0 made equal.

TGN's memory keeps each node's last update time in a buffer started at 0; JODIE's time-gap
normalisation divides ``dt = t - last_update`` by the std of the gaps. A first batch that is a
bulk import (every event at one timestamp) has every gap equal, the std is 0 and the division
0/0. Filling ``last_update`` with random values makes the gaps differ and the call finite, so
the zero state looks to blame, as a power iteration's ``u`` started at zeros is; but a nonzero
constant in its place keeps the gaps equal and the call non-finite: the divisor measures how
much values differ, and the data left them all equal. The fix is then an eps on the divisor,
not a nonzero start (a start of 0 is what TGN writes). Told apart by one forward more, with
the state filled with ones.
"""

from __future__ import annotations

EQUAL_SPREAD = (
    "{op}'s divisor is a spread (std, variance, range) of values that are all equal in this "
    "step: they come from {what}, all 0 as the step began, and with random values in its "
    "place the call is finite, but with a nonzero constant in its place it is not, so its "
    "zero start is not the bug. A std of values that can all be equal (a batch of events at "
    "one timestamp, a constant feature, the first batch that starts a running statistic) is "
    "0 by the data: add an eps to the divisor (std + eps, sqrt(var + eps)) or clamp it "
    "(std.clamp_min(eps))")


# (a trained layer of zeros: with ones in its place the divisor is still 0, so the values it
# compares are equal for another reason, the parameters they start from)
EQUAL_TERMS = (
    "{op}'s divisor is 0 in every sample because the values it compares are equal: they come "
    "through {what}, all 0 as the step began, and with random values in its place the call "
    "is finite, but with a nonzero constant in its place it is not, so that layer's zero "
    "start only hides what else makes them equal: parameters started at the same value (two "
    "rates of a closed form: a Bateman function's ka / (ka - ke) at ka = ke; a divided "
    "difference (f(a) - f(b)) / (a - b) at a = b). Start them apart, and where the formula "
    "has a removable singularity take its limit where they meet (torch.where(|a - b| > eps, "
    "formula, limit)) or parameterise them so they cannot meet (ka = ke + softplus(d))")


def equal_spread_hint(op: str, what: str, finite_with_ones) -> str | None:
    """The hint when a state ``what`` all 0 makes the divisor 0 only by making values equal
    (see the module doc), else None. ``finite_with_ones()``: whether the origin's call is
    finite with the state filled with ones."""
    return None if finite_with_ones() else EQUAL_SPREAD.format(op=op, what=what)
