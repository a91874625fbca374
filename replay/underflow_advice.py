"""The advice for a divisor that underflowed to 0, by how it was made. One from exp, softmax
or sigmoid (``Evidence.exp_made``) has a log-space rewrite; a product or difference of small
finite numbers has none in the code (a 2x2 determinant ``a * c - b * b`` of a Gaussian splat
collapsed to a point, without gsplat's 0.3 dilation of its 2-D covariance), and the fix is a
floor where it is made, which the log-space list (log_softmax, logsumexp, a Cox loss) hides."""

from __future__ import annotations

from .cause_text import DO

_DIVISIONS = {"div", "div_", "reciprocal", "reciprocal_", "rsqrt", "rsqrt_"}

FLOOR = ("it is made of small finite numbers (products, differences), not of an exponential, "
         "so no log-space form exists: keep it away from 0 where it is made (a floor on its "
         "factors, as a minimum scale; a matrix dilated before its determinant, as gsplat "
         "adds 0.3 to a splat's 2-D covariance), clamp it before the division "
         "(det.clamp_min(eps)), or compute it in float64")


def underflow_advice(name: str, ev, i: int) -> str:
    """``DO["log_space"]`` unless input ``i`` of op ``name`` is a divisor no exponential made."""
    if name in _DIVISIONS and not ev.exp_made[i] and (name != "div" or i == 1):
        return FLOOR
    return DO["log_space"]
