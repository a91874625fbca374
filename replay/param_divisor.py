"""The hint for a division whose divisor is one of the model's parameters at exactly 0
(RMTPP's closed-form integral ``(exp(a) - exp(a + w * dt)) / w`` once its learned ``w`` is
0). A learned value divides every sample alike, so no row is to blame, and the advice for a
0-d divisor made of the batch (clamp a count, add an eps to a statistic, skip such batches)
would leave it at 0: the fix is to that parameter, or to the formula's limit there."""

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
    return (f"{hit.op} of {'0 by 0 (0/0)' if both else 'a number by 0 (x/0)'}: the divisor is "
            f"the parameter {name} (as it is, or through ops of it alone: a clamp or relu at "
            "0), exactly 0 in this step (as initialised, or where an update stepped it), a "
            "learned value, the same for every sample, so no row is to blame and neither an "
            "eps in the data nor skipping batches helps: keep it away from 0 by construction "
            f"(learn its log and use .exp(), or softplus({name}) + eps; a clamp or relu at 0 "
            "reaches 0 exactly, and its gradient there is 0, so it stays), or, where the "
            "formula has a finite limit at 0 (a closed-form integral (exp(a + w * t) - exp(a)) "
            "/ w tends to exp(a) * t), compute that limit there")
