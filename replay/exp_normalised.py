"""A 0/0 of exponentials normalised by their own sum: a softmax written by hand.

MPPI's path-integral weights ``w = exp(-S / lambda); w / w.sum()``, an attention or a mixture's
responsibilities written as ``exp(s) / exp(s).sum(dim)``: where every term of a row is below
the type's range (costs above about 104 for float32), the numerator and the sum both
underflow to 0 and the weights are 0/0. ``torch.softmax`` subtracts the row's max first, so
its largest term is 1; a clamp of the sum, the generic advice for an underflowed divisor,
would instead leave every weight of the row at 0.
"""

from __future__ import annotations


def normalised(ev, zeros: list[int]) -> tuple[str, str] | None:
    """(where the 0s came from, what to do) when the op's two inputs both underflowed, the
    first exp's own result and the second a sum or product of exponentials; else None."""
    if zeros != [0, 1] or len(ev.inputs) != 2 or len(ev.of_exp) != 2 \
            or not ev.of_exp[0] or ev.of_exp[1]:
        return None
    return ("exp of a finite argument, divided by a sum of such exps (a softmax or "
            "normalised weights written by hand, exp(s) / exp(s).sum(dim): MPPI's path-integral "
            "weights exp(-S / lambda)) where every term of the row is below the type's range",
            "use torch.softmax(s, dim) (log_softmax where a log follows), which subtracts the "
            "row's max so its largest term is 1, or subtract the max (a cost's min) before exp "
            "yourself; a clamp of the sum would leave every weight of the row at 0")
