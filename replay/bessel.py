"""A modified Bessel function that overflowed (``torch.special.i0``, ``torch.i0``,
``torch.special.i1``, ``modified_bessel_i0``/``_i1``): it grows like e^x / sqrt(2 pi x), past
float32's range from x ≈ 90 and float64's from x ≈ 713, so where a likelihood takes its log (a
von Mises or von Mises-Fisher normaliser, log I0(kappa) of a learned concentration) neither a
clamp of kappa nor float64 is the fix: the exponentially scaled variant is finite for any x."""

from __future__ import annotations

from .cause_text import DO

# the op (aten name, no prefix) and its exponentially scaled variant, I(x) = scaled(x) e^|x|
_SCALED = {"i0": "i0e", "special_i0": "i0e", "special_modified_bessel_i0": "i0e",
           "special_i1": "i1e", "special_modified_bessel_i1": "i1e"}
BESSEL = frozenset(_SCALED)  # no pole, no domain edge: a non-finite value is an overflow
# the generic advice of an overflow's hint, which the scaled variant's replaces
_GENERIC = ("clamp", "clamp_exp", "wider64", "wider64_exp")


def scaled_log(op: str, found) -> str:
    """The hint of ``found`` (a ``Cause`` of op ``op``), its advice the scaled variant's where
    ``op`` is a modified Bessel function that overflowed."""
    scaled = _SCALED.get(op.removeprefix("aten.").rstrip("_"))
    if found.name != "overflow" or scaled is None:
        return found.hint
    fix = (f"{op} grows like e^|x| / sqrt(2 pi |x|): take its log from the exponentially "
           f"scaled variant, log(torch.special.{scaled}(x)) + x.abs() (a von Mises normaliser "
           f"log(2 pi I0(kappa))), finite for any x, where a clamp of x caps the concentration "
           f"and float64 only moves the overflow to x ≈ 713")
    for key in _GENERIC:
        if found.hint.endswith(DO[key]):
            return found.hint[:-len(DO[key])].removesuffix(": ") + "; " + fix
    return f"{found.hint}; {fix}"
