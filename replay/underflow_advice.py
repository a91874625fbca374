"""The advice for a divisor that underflowed to 0, by how it was made. One from exp, softmax
or sigmoid (``Evidence.exp_made``) has a log-space rewrite; a product or difference of small
finite numbers has none in the code (a 2x2 determinant ``a * c - b * b`` of a Gaussian splat
collapsed to a point, without gsplat's 0.3 dilation of its 2-D covariance), and the fix is a
floor where it is made, which the log-space list (log_softmax, logsumexp, a Cox loss) hides.
A log of the exp itself (``var = log_var.exp()`` then ``log(var)`` in a hand-written Gaussian
NLL) needs none of that list: the round trip is the exponent. A 0/0 of exponentials over
their own sum (a softmax written by hand, ``replay.exp_normalised``) needs torch.softmax, not a
clamp of the sum, also where float64 still holds the terms (an RPM affinity
``exp(-d / tau)`` of a cloud in centimetres: 1e-99)."""

from __future__ import annotations

from .cause_text import DO
from .chain_product import CHAIN, LEAST
from .exp_normalised import normalised
from .exp_param import exp_param_advice
from .positive import node_op
from .shifted_positive import ADVICE as SHIFTED

_DIVISIONS = {"div", "div_", "reciprocal", "reciprocal_", "rsqrt", "rsqrt_"}
PICKS = {"index", "index_select", "gather", "masked_select", "take"}  # (aten names of those)
_LOGS = {"log", "log_", "log2", "log10"}
# views, and picks of entries (a point process's ``lam[presence]``): exp's values all the same
_VIEWS = {"View", "UnsafeView", "Reshape", "ReshapeAlias", "Squeeze", "Unsqueeze", "Select",
          "Slice", "Expand", "Clone", "Alias", "Index", "IndexSelect", "Gather", "MaskedSelect"}

LOG_OF_EXP = ("its input is an exp's result (log(exp(x)) is x): take the exponent itself "
              "instead of the log of its exp (a Gaussian NLL's 0.5 * log_var, with "
              "(y - mu) ** 2 * torch.exp(-log_var) for the division), which no underflow "
              "reaches; or ")

FLOOR = ("it is made of small finite numbers (products, differences), not of an exponential, "
         "so no log-space form exists: keep it away from 0 where it is made (a floor on its "
         "factors, as a minimum scale; a matrix dilated before its determinant, as gsplat "
         "adds 0.3 to a splat's 2-D covariance), clamp it before the division "
         "(det.clamp_min(eps)), or compute it in float64")


def made_by_exp(t, depth: int = 6, fn=None) -> bool:
    """Whether tensor ``t`` is (a view or a pick of) ``exp``'s result, on the autograd graph (so only
    when the forward recorded gradients; ``fn``: the node that made a detached copy ``t``)."""
    try:
        fn = fn or t.grad_fn
        for _ in range(depth):
            if fn is None:
                return False
            op = node_op(fn)
            if op == "Exp":
                return True
            if op not in _VIEWS:
                return False
            fn = next((f for f, _ in fn.next_functions if f is not None), None)
    except Exception:  # not an autograd node, or one that cannot say
        return False
    return False


def underflow_advice(name: str, ev, i: int) -> str:
    """``DO["log_space"]`` unless input ``i`` of op ``name`` is a divisor no exponential made
    or (first) a log's input that exp itself made; a hand-written softmax's 0/0 first."""
    if name == "div" and (own := normalised(ev, _zeros(ev))) is not None:
        return f"{own[0]}: {own[1]}"
    if name in _DIVISIONS and (name != "div" or i == 1) and (p := exp_param_advice(ev, i)):
        return p
    if name in _DIVISIONS and not ev.exp_made[i] and (name != "div" or i == 1):
        op = ev.shifted[i] if i < len(ev.shifted) else None
        return SHIFTED.format(op=op) if op else FLOOR
    if (name in _LOGS or name in _DIVISIONS) and i < len(ev.chained) \
            and ev.chained[i] >= LEAST:  # (before FLOOR: a chain's 0 has a log-space form)
        return CHAIN.format(n=ev.chained[i])
    if name in _LOGS and i < len(ev.of_exp) and ev.of_exp[i]:
        return LOG_OF_EXP + DO["log_space"]
    return DO["log_space"]


def _zeros(ev) -> list[int]:
    """The op's inputs that are 0 wherever it went non-finite."""
    return [j for j, v in enumerate(ev.inputs)
            if v.numel() and not bool(v.ne(0).any())]
