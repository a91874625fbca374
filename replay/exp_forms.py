"""The exponent form of a backward pole reached at an exponential's underflowed value.

A VAE's standard deviation written ``logvar.exp().sqrt()`` (AVITM's ProdLDA) is finite in the
forward when ``exp`` underflows to 0, but the derivative of ``sqrt`` is infinite there; the
generic log-space list (log_softmax, logsumexp, a Cox loss's risk sets) names no rewrite of
it, while ``sqrt(exp(x))`` is ``exp(0.5 * x)``, which has no pole. Likewise ``rsqrt(exp(x))``
is ``exp(-0.5 * x)`` and ``log(exp(x))`` is ``x``. A log of a matrix product of two such
values, a mixture of distributions (the embedded topic model's ``log(theta @ beta)`` of two
softmaxes), has the form ``logsumexp`` over the contracted dimension of their logs.
"""

from __future__ import annotations

from .cause_text import DO
from .positive import made_positive, node_op

_VIEWS = {"View", "UnsafeView", "Reshape", "ReshapeAlias", "Squeeze", "Unsqueeze", "Expand",
          "Clone", "Alias", "T", "Transpose", "Permute"}
_FORMS = {"Sqrt": "sqrt(exp(x)) is exp(0.5 * x)", "Rsqrt": "rsqrt(exp(x)) is exp(-0.5 * x)",
          "Log": "log(exp(x)) is x"}
_PRODUCTS = {"Mm", "Bmm", "Addmm", "Baddbmm", "Mv"}

ROOT = ("compute in log space, {form}: take that form instead of the op of an exp's result "
        "(a VAE's standard deviation from its log-variance, std = torch.exp(0.5 * logvar), "
        "not logvar.exp().sqrt()), whose derivative has no pole for exp's 0 to reach")
MIXTURE = ("the log is of a matrix product of values positive in exact arithmetic (a mixture "
           "of distributions: a topic model's log(theta @ beta) of two softmaxes), whose "
           "entries underflowed: compute it in log space, torch.logsumexp(log_theta[:, :, None]"
           " + log_beta[None], dim=1) with both logs from log_softmax, which no underflow "
           "reaches")


def _through_views(fn, depth: int = 6):
    for _ in range(depth):
        if fn is None or node_op(fn) not in _VIEWS:
            return fn
        fn = next((f for f, _ in fn.next_functions if f is not None), None)
    return fn


def exp_form(node) -> str | None:
    """The rewrite of backward node ``node`` (sqrt, rsqrt or log) whose input is an exp's
    result or a matrix product of positive values, else None."""
    try:
        op = node_op(node)
        if op not in _FORMS:
            return None
        made = _through_views(next((f for f, _ in node.next_functions if f is not None), None))
        if made is None:
            return None
        if node_op(made) == "Exp":
            return ROOT.format(form=_FORMS[op])
        if op == "Log" and node_op(made) in _PRODUCTS:
            factors = [f for f, _ in made.next_functions if f is not None]
            if node_op(made) in ("Addmm", "Baddbmm"):
                factors = factors[1:]
            if len(factors) >= 2 and all(made_positive(f) for f in factors[-2:]):
                return MIXTURE
    except Exception:  # not an autograd node, or one that cannot say
        return None
    return None


def exp_form_hint(b, cause) -> str:
    """``cause``'s hint for backward origin ``b``, for an underflow at that node's pole, with
    its exponent form in place of the generic log-space list (kept after it as the fallback
    of a clamp)."""
    if cause.name != "underflow" or not b.exp_form:
        return cause.hint
    if DO["log_space"] in cause.hint:
        return cause.hint.replace(DO["log_space"], b.exp_form + "; or clamp the value away "
                                  "from 0 (x.clamp_min(eps)) before the op")
    return f"{cause.hint}; {b.exp_form}"
