"""The hint for a division whose divisor is one of the model's parameters at exactly 0
(RMTPP's closed-form integral ``(exp(a) - exp(a + w * dt)) / w`` once its learned ``w`` is
0). A learned value divides every sample alike, so no row is to blame, and the advice for a
0-d divisor made of the batch (clamp a count, add an eps to a statistic, skip such batches)
would leave it at 0: the fix is to that parameter, or to the formula's limit there. A divisor
made of the parameter by adding a number to it (Barron's general robust loss,
``|alpha - 2| / alpha * (((x / c)^2 / |alpha - 2| + 1)^(alpha / 2) - 1)``, with alpha started
at 2, its L2 point) is 0 where the parameter takes that number's value, not at 0: a
singular point of the formula, which a positive parametrisation does not keep away."""

from __future__ import annotations

# (replay.param_names names a division's divisor as the op's parameter)
_DIVISIONS = {"aten.div", "aten.true_divide"}


def divisor_hint(hint: str, cause: str, hit) -> str | None:
    """The hint for ``hit``, a division by the parameter ``hit.param``: the whole of it at 0,
    ``hint`` as it is otherwise (the generic parameter advice would quote the numerator's
    range as the parameter's value); None when ``hit`` is no division by a parameter."""
    if hit is None or hit.param is None or hit.op not in _DIVISIONS:
        return None
    if cause != "invalid":
        return hint
    ev, name = hit.evidence, hit.param
    both = ev is not None and bool(ev.inputs) and bool((ev.inputs[0] == 0).any())
    if ev is not None and ev.param_shift is not None and ev.param_shift[0] == name:
        return shifted_hint(hit.op, both, name, ev.param_shift[1])
    return (f"{hit.op} of {'0 by 0 (0/0)' if both else 'a number by 0 (x/0)'}: the divisor is "
            f"the parameter {name} (as it is, or through ops of it alone: a clamp or relu at "
            "0), exactly 0 in this step (as initialised, or where an update stepped it), a "
            "learned value, the same for every sample, so no row is to blame and neither an "
            "eps in the data nor skipping batches helps: keep it away from 0 by construction "
            f"(learn its log and use .exp(), or softplus({name}) + eps; a clamp or relu at 0 "
            "reaches 0 exactly, and its gradient there is 0, so it stays), or, where the "
            "formula has a finite limit at 0 (a closed-form integral (exp(a + w * t) - exp(a)) "
            "/ w tends to exp(a) * t), compute that limit there")


def shifted_hint(op: str, both: bool, name: str, value: float) -> str:
    """The hint for a division by a value made of ``name`` by adding a number to it, 0 at
    the parameter's ``value`` (``|alpha - 2|`` at alpha = 2)."""
    return (f"{op} of {'0 by 0 (0/0)' if both else 'a number by 0 (x/0)'}: the divisor is "
            f"made of the parameter {name} alone by adding a number to it ({name} - c, "
            f"|{name} - c|), and {name} is {value:.6g} in this step (as initialised, or where "
            "an update stepped it), the very value where that difference is 0: a singular "
            "point of the formula (Barron's general robust loss divides by |alpha - 2| and "
            "is singular at its L2 point alpha = 2), the same for every sample, so no row is "
            "to blame, and neither an eps in the data nor a positive parametrisation "
            f"(exp, softplus) of {name} helps: where the formula has a finite limit there "
            "(Barron's loss tends to 0.5 (x / c)^2 as alpha -> 2), compute that limit at "
            f"that value, or keep the difference away from 0 by its sign ({name} - c "
            f"replaced by its sign times max(|{name} - c|, eps)), or start {name} elsewhere")
