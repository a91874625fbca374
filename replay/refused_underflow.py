"""A distribution's parameter refused as 0, in float64 too, made by an op positive in exact
arithmetic.

``Normal(mean, F.softplus(z).sqrt())`` of a record whose feature is out of scale (a raw view
count, 2e5, among standardised ones): ``z`` is about -2e4, and softplus of it is e^-20000,
below float64's range as well, so the float64 re-run refuses it too. That is no value the code
gives "by construction" (``invalid``): softplus, exp and sigmoid are never 0, it underflowed,
and the data-scale note (:mod:`replay.data_scale`) can then name the record.
"""

from __future__ import annotations

from .positive import POSITIVE


def positive_underflow(refused: str, seen: str, op: str | None) -> tuple[str, str] | None:
    """``("underflow", hint)`` when aten op ``op`` (``aten.softplus``) that made the refused
    zeros is positive in exact arithmetic for every finite argument; else None."""
    name = (op or "").removeprefix("aten.")
    if name not in POSITIVE:
        return None
    return "underflow", (
        f"{refused}: {seen}, in float64 too, but {op} is positive in exact arithmetic: its "
        "argument was so far below 0 that even float64 underflows, an input out of scale or "
        "a diverged pre-activation rather than a rounding: bound the value below where it "
        "is made (F.softplus(x) + 1e-4, x.exp().clamp_min(1e-6)) and check that argument's "
        "inputs")
