"""A 0 that a square of a non-zero value made: an underflow, not an exact 0.

A power spectrum ``re ** 2 + im ** 2`` of a near-silent clip (samples around 1e-24, a
resampler's ringing) holds values below float32's smallest subnormal: the squares round to 0,
``sqrt`` keeps that 0 and the magnitude's ``log`` is -inf several ops later. Where the squared
value was non-zero in its own type, exact arithmetic keeps the square positive; the report said
``precision`` (rounding "across the domain edge", a cancellation) where nothing cancelled.
:class:`replay.positive.Partly` marks such squares as positive where their base is non-zero,
and this module words the cause.
"""

from __future__ import annotations

from .exp_normalised import normalised
from .positive_maker import source as made_source

__all__ = ["source"]

# a value of either sign that exact arithmetic keeps non-zero (replay.nonzero)
SIGNED = ("a signed value non-zero in exact arithmetic, {} of a finite argument times factors "
          "of either sign that are never 0 (a signed amplitude exp(s) * polarity, "
          "sign(w) * softplus(v))")
SIGNED_FIX = ("keep its magnitude in log space (a division by exp(s) * p as a product by "
              "exp(-s) * p, log(amp ** 2) as 2 * s) or floor the magnitude before the sign is "
              "applied (exp(s).clamp_min(eps) * p, softplus(v).clamp_min(eps) * sign(w))")


def source(ev, zeros: list[int], positive_ops: str, log_space: str,
           name: str = "") -> tuple[str, str]:
    """(where op ``name``'s 0 came from, what to do) for its inputs ``zeros`` holding an
    underflowed 0 that exact arithmetic keeps positive: a square's, a hand-written softmax's,
    else the log-space form of the op that made it (replay.positive_maker)."""
    if all(i < len(ev.signed) and ev.signed[i] for i in zeros):
        return SIGNED.format(positive_ops), SIGNED_FIX
    if all(i < len(ev.squared) and ev.squared[i] for i in zeros):
        return ("a square of a non-zero value (x ** 2, x * x; a power spectrum re² + im² of a "
                "near-silent clip), positive in exact arithmetic, or what sums and roots made "
                "of it",
                "floor it before the op (power.clamp_min(eps): parallel_wavegan's STFT "
                "magnitude clamps re² + im² at 1e-7), or scale the values up before squaring")
    if (own := normalised(ev, zeros)) is not None:
        return own
    if (made := made_source(name, ev, zeros)) is not None:  # (its own form, then the rest)
        return made[0], f"{made[1]}; else {log_space}" if made[2] else made[1]
    return (f"{positive_ops} of a finite argument (or a sum or matrix product of such values: a "
            "softmin's sum(exp(-r / gamma)), Sinkhorn's K @ v with K = exp(-C / eps); a "
            "power of a base > 0 of any finite exponent, 2 ** t, torch.pow(0.5, t); or a "
            "product of one with factors > 0: a density written out, y ** (a - 1) * "
            "exp(-y / b), whose log is the sum of its factors' logs, or log_prob), positive "
            "in exact arithmetic", log_space)
