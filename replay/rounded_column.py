"""A 0/0 in whole columns of a batch statistic that float64 keeps apart: the feature is one
value in the step's type, not in exact arithmetic.

``(u - u.mean(0)) / u.std(0)`` divides 0 by 0 in a column whose values are all equal. When the
float64 re-run holds them apart (by far less than the type's spacing), rounding made them equal:
a squashing function saturated in every row (tanh or sigmoid rounded to exactly ±1, a hash
layer's ``tanh(beta * x)`` after a continuation grew ``beta``), or values closer than the type
resolves. That is no catastrophic cancellation (``torch.std`` already centres before squaring,
so a stable variance formula changes nothing); the statistic is exactly 0 for a constant
feature however it is computed: an eps on it is the fix, as for a feature constant in exact
arithmetic (``DO["divide_feature"]``).
"""

from __future__ import annotations

from . import lost_eps
from .cause_text import DO
from .ops import Evidence

SITUATION = "divide_feature"


def hint(situation: str, what: str, dt: str, ev: Evidence) -> str | None:
    """The precision hint of a whole-column 0/0 (``situation`` from ``domains.describe``),
    else None (an eps the divisor had and the type lost is ``lost_eps``'s); ``what`` says what
    the op was given (with float64's value there)."""
    if situation != SITUATION or lost_eps.context(ev):
        return None
    return (f"{what}: those columns hold one value in every row in {dt} though not in "
            f"float64, so rounding made the feature constant (a tanh or sigmoid saturated to "
            f"exactly ±1 in every row, its input scaled up: a hash layer's tanh(beta * x) "
            f"after beta grew; or values closer than {dt}'s spacing), and a statistic of a "
            f"constant feature is exactly 0 however it is computed: " + DO[SITUATION]
            + "; keep a scaled squashing function short of saturation (cap its scale)")
