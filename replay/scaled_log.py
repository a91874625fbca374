"""An overflow of a function that grows like e^|x| and whose log is what a loss wants: a
modified Bessel function (``torch.special.i0``, ``torch.i0``, ``torch.special.i1``,
``modified_bessel_i0``/``_i1``: a von Mises or von Mises-Fisher normaliser, log I0(kappa) of a
learned concentration), sinh or cosh (the log-cosh loss, the normaliser kappa / sinh(kappa) on
S^2). Past float32's range from x ≈ 90 and float64's from x ≈ 710, so neither a clamp of x
(which caps the concentration) nor float64 is the fix: the log written without the overflowing
value (the exponentially scaled variant, a log-space identity) is finite for any x.

So is ``nn.SoftMarginLoss``, whose kernel takes ``log(1 + exp(-y * x))`` without softplus's
linear branch: the stable form, ``F.softplus(-y * x)``, is finite for any score.

So is a softmax written out, ``exp(x) / exp(x).sum(-1)`` (a profile's probabilities, then their
log): where a narrow type's exp overflowed and the advice said only to widen it, it adds that
``softmax``/``log_softmax`` subtract the row max first (:data:`SOFTMAX`)."""

from __future__ import annotations

# a modified Bessel function (aten name, no prefix) and its exponentially scaled variant,
# I(x) = scaled(x) e^|x|
_SCALED = {"i0": "i0e", "special_i0": "i0e", "special_modified_bessel_i0": "i0e",
           "special_i1": "i1e", "special_modified_bessel_i1": "i1e"}
BESSEL = frozenset(_SCALED)  # no pole, no domain edge: a non-finite value is an overflow
_HYPERBOLIC = ("log(cosh(x)) = x.abs() + log1p(exp(-2 * x.abs())) - log(2), log(sinh(x)) = "
               "x + log1p(-exp(-2 * x)) - log(2) for x > 0")

# fused ops whose result is finite where their exp, taken on the way, overflows
INNER_EXP = frozenset({"soft_margin_loss"})

SOFTMAX = ("; where the exp is normalised by its sum (a softmax or its log written out, "
           "exp(x) / exp(x).sum(-1)), use torch.softmax or log_softmax on x: they subtract the "
           "row max first, so no term exceeds 1 in any type")


def log_advice(op: str, advice: str) -> str:
    """What to do where op ``op`` overflowed: the log written without it where ``op`` is such
    a function, else ``advice`` (a clamp, a rescaling, float64)."""
    name = op.removeprefix("aten.").rstrip("_")
    if name in _SCALED:
        return (f"take its log without the overflowing value ({op} grows like e^|x| / "
                f"sqrt(2 pi |x|)): the exponentially scaled variant, "
                f"log(torch.special.{_SCALED[name]}(x)) + x.abs() (a von Mises normaliser "
                "log(2 pi I0(kappa))), is finite for any x, where a clamp of x caps the "
                "concentration and float64 only moves the overflow to x ≈ 713")
    if name in ("sinh", "cosh"):
        return (f"where its log is taken (a log-cosh loss, a von Mises-Fisher normaliser "
                f"kappa / sinh(kappa)), write the log without the overflowing value ({op} "
                f"grows like e^|x| / 2): {_HYPERBOLIC}, finite for any x; else " + advice)
    if name in INNER_EXP:
        return (f"{op} takes log(1 + exp(-y * x)) with exp(-y * x) as is, which leaves "
                "float32's range once a score has the wrong sign by more than 88.7 (float64's "
                "by 709), though the loss there is finite (about -y * x); compute it as "
                "F.softplus(-y * x).mean(), which is linear there, or keep the scores in "
                "range (a normalised head; a temperature)")
    if name in ("exp", "exp2") and "row max" not in advice:
        return advice + SOFTMAX
    return advice
