"""Which op made a value positive in exact arithmetic, so that an underflow's hint names the
log-space rewrite of that op: a router's ``sigmoid`` scores (logsigmoid), a likelihood's
``prod`` of many probabilities (the sum of their logs), a power of a small base (its
exponent times the log of the base).

The op finder marks such values (:mod:`replay.positive`) without saying which op started the
mark; the autograd graph does, walked back from the value through what passes it on (views,
picks, top-k, sums, a division by a finite value).
"""

from __future__ import annotations

from .positive import first_inputs

# nodes whose value is positive for a positive first input, walked through
_THROUGH = {"View", "UnsafeView", "Reshape", "ReshapeAlias", "Squeeze", "Unsqueeze", "Select",
            "Slice", "Expand", "Clone", "Alias", "Index", "IndexSelect", "Gather", "Topk",
            "Sort", "Max", "Amax", "Kthvalue", "Sum", "Mean", "Div", "Mul", "Permute",
            "Transpose", "T", "Flip", "Roll", "Repeat", "Cat", "Stack", "Cumsum", "Narrow"}
# nodes that make the positive value, by the name a hint gives them
MAKERS = {"Exp": "exp", "Exp2": "exp", "Sigmoid": "sigmoid", "Softmax": "softmax",
          "Softplus": "softplus", "Prod": "prod", "Cumprod": "cumprod", "Pow": "pow"}


def positive_maker(t, depth: int = 12) -> str | None:
    """The op (a :data:`MAKERS` value) that made tensor ``t``'s positive values, found on its
    autograd graph; None off the graph or through another op."""
    try:
        for op, _ in first_inputs(getattr(t, "grad_fn", None), depth):
            if op in MAKERS:
                return MAKERS[op]
            if op not in _THROUGH:
                return None
    except Exception:  # not an autograd node, or one that cannot say
        return None
    return None


# what made it, and the log of it that no underflow reaches, by maker
_MADE = {"sigmoid": ("sigmoid of a finite argument (a gate's or a router's scores, a "
                     "probability)", "F.logsigmoid(z) for log(sigmoid(z)): logsigmoid or "
                     "BCEWithLogitsLoss on the logits in a loss"),
         "softmax": ("softmax of a finite row", "F.log_softmax(z, dim) for log(softmax(z))"),
         "exp": ("exp of a finite argument", "the exponent itself for log(exp(x))"),
         "softplus": ("softplus of a finite argument",
                      "the argument itself where it is far below 0 (softplus(x) ~ exp(x))"),
         "prod": ("a product of factors > 0 (many probabilities multiplied: a likelihood of "
                  "independent terms)", "the sum of the factors' logs for log(prod(p)), "
                  "F.logsigmoid for sigmoid probabilities"),
         "cumprod": ("a running product of factors > 0 (cumprod of probabilities: a survival "
                     "curve)", "torch.cumsum of the factors' logs for log(cumprod(p))"),
         "pow": ("a power of a base > 0", "the exponent times the base's log for "
                 "log(p ** k)")}
_DIVISIONS = {"div", "div_", "true_divide"}
WIDER = ", and below float64's range as well, so a wider type does not fix it"


def source(name: str, ev, zeros: list[int]) -> tuple[str, str, bool] | None:
    """(where op ``name``'s underflowed 0s came from, what to do, whether the general log-space
    advice applies too) when one op named in :data:`MAKERS` made them all
    (``ev.positive_by``), else None: the log-space form of that op (a log of a sum of such
    values wants logsumexp, which the general advice names), and for a 0/0 of weights over
    their own sum, a softmax of their logs."""
    makers = {ev.positive_by[i] if i < len(ev.positive_by) else None for i in zeros}
    if len(makers) != 1 or (maker := makers.pop()) not in _MADE:
        return None
    made, log_form = _MADE[maker]
    src = f"{made}, positive in exact arithmetic"
    if name in _DIVISIONS and zeros == [0, 1]:
        return src, ("normalise in log space: w / w.sum(dim) is torch.softmax(log_w, dim), "
                     f"with log_w computed directly ({log_form}), which subtracts the row's "
                     "max so its largest weight is 1; an eps added to the sum would leave "
                     "every weight of the row at 0"), False
    if name in _DIVISIONS:
        return src, (f"keep the divisor as its log ({log_form}) and divide in log space "
                     "(exp(log_a - log_w), torch.logsumexp for a sum of such terms), or "
                     "bound it away from 0 where it is made"), False
    return src, f"compute in log space: {log_form}, which no underflow reaches", True
