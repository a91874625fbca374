"""A power ``x ** n`` of a fixed exponent that overflowed on bases above 1.

A dense associative memory's rectified polynomial energy ``relu(x) ** n`` (Krotov & Hopfield,
n up to 40 and more), a polynomial kernel's ``(1 + x.y) ** d``: the exponent is a constant
of the code, the base grew past ``max ** (1 / n)`` (9.2 for n = 40 in float32). The overflow
advice for an exponential (subtract the row max before exp, bound a learned exponent) names
neither: the power's own fix is to divide the base by its largest value before the power, so
the largest term is 1 and the scale ``m ** n`` is carried apart (in log space, or cancelled
by a normalisation after it), or to lower ``n``.
"""

from __future__ import annotations

from numbers import Real

# the largest base an exponent, not the base's own scale, overflows: a square of 1e20 is a
# value already out of any scale (the data's or a divergence's), not a power to normalise
ORDINARY = 1e4

ADVICE = ("the base is above 1 under a power of {n:g}: divide it by its largest value before "
          "the power ((x / m) ** n with m = x.amax(-1, keepdim=True).clamp_min(1), the largest "
          "term 1, as dense associative memories normalise their rectified polynomial), "
          "carrying m ** n in log space (n * log m) or cancelling it with a normalisation after, "
          "lower the power, or compute it in float64")


def power_advice(op: str | None, ev) -> str | None:
    """The advice for a ``pow`` of a tensor base and a constant exponent above 1 that
    overflowed where every base's magnitude is above 1 and at most :data:`ORDINARY`, else
    None (a learned exponent, a constant base ``2 ** x``, a base near 0 under a negative
    power or a base itself out of scale keep their own)."""
    if op is None or op.removeprefix("aten.") != "pow" or ev is None or len(ev.args) < 2:
        return None
    base, n = ev.args[0], ev.args[1]
    if base is not None or isinstance(n, bool) or not isinstance(n, Real) or n <= 1 \
            or not ev.inputs or not ev.inputs[0].numel():
        return None
    size = ev.inputs[0].abs()
    if float(size.min()) <= 1 or float(size.max()) > ORDINARY:
        return None
    return ADVICE.format(n=float(n))
