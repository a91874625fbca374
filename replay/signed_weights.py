"""A learned weighting of non-negative values that an update made negative, where an op
takes it out of its domain.

GDN written without its ``NonNegativeParametrizer`` learns ``gamma`` and ``beta`` as they are:
``norm = conv2d(x ** 2, gamma, beta)`` is a sum of squares only while every weight is >= 0.
Adam steps entries of ``gamma`` below 0, the norm goes negative where ``x`` is large, and
``sqrt(norm)`` is NaN. The generic hint (clamp the op's input into its domain) would hide
the negative weights, not fix them: :func:`signed_weights_hint` names them and says to keep
them non-negative. Read on the autograd graph of the origin's module call, re-run once.
A mixture of densities ``log((lp.exp() * w).sum(-1))`` with ``w = weights / weights.sum()``
(weights normalised by their sum rather than a softmax) is the same sum written elementwise:
an update steps one weight below 0 and the mixture density goes negative where that
component dominates. A learned filterbank ``fb @ spec.abs() ** 2`` is the same sum with the weight on the left and
the data off the graph (a spectrum of audio that needs no gradient): ``matmul``'s mm and the
views after it are read both ways. An offset added to non-negative values is the same
(PCEN's ``(E / M ** alpha + delta) ** r`` with ``delta`` learned as is, initialised below 0):
the other addend is read back from the op's input less the parameter.
"""

from __future__ import annotations

import torch

from .errors import StopRun
from .positive import node_name, node_op
from .rerun import Runner

# ops with a domain a negative input leaves (the hit's aten op, as its node is named)
_DOMAIN = {"sqrt", "rsqrt", "log", "log2", "log10", "pow"}
# weighted sums: the node, its saved data input, where that input and the weight and bias
# come in
_PRODUCTS = {"Convolution": ("input", 0, (1, 2)), "Addmm": ("mat1", 1, (0, 2)),
             "Mm": ("self", 0, (1,)), "Bmm": ("self", 0, (1,))}
# ops whose values are >= 0 by their math (x ** 2, |x|, exp), not a layer's activation (a
# ReLU feature's weighting is any Linear's, whose output is free to be negative)
_NON_NEGATIVE = {"Pow", "Abs", "Exp", "Softplus", "Sigmoid"}
_VIEWS = {"View", "UnsafeView", "Reshape", "ReshapeAlias", "Permute", "Transpose", "T",
          "Expand", "Unsqueeze", "Squeeze", "Clone", "ToCopy"}


def signed_weights_hint(runner: Runner, origin, hit) -> str | None:
    """The hint for an ``invalid`` ``hit`` (sqrt, log, a power) of a negative input that a
    conv or matrix product of non-negative values made with parameters holding negative
    entries, else None."""
    op = hit.op.removeprefix("aten.") if hit is not None else ""
    if op not in _DOMAIN or hit.input_min is None or not hit.input_min < 0 \
            or runner.model is None:
        return None
    try:
        module = runner.model.get_submodule(origin.module or "")
    except AttributeError:
        return None
    if not any(bool((p < 0).any()) for p in module.parameters()):
        return None  # (no re-run: the call's own weights are all non-negative)
    out = _call_output(runner, origin, module)
    try:
        found, offset = _weights_under(out, node_name(op)) if out is not None else ([], False)
    except Exception:  # (a node that cannot say: a freed buffer, a custom Function's)
        return None
    if not found:
        return None
    names = {id(p): n for n, p in runner.model.named_parameters()}
    named = [(names[id(p)], float(p.detach().min())) for p in found if id(p) in names]
    if not named:
        return None
    said = ", ".join(f"{n} (min {lo:.3g})" for n, lo in named)
    verb = "hold" if len(named) > 1 else "holds"
    how = "a weighted sum of non-negative values (a conv or matrix product of x ** 2, |x|, " \
        "exp; a mixture's densities times its weights, summed) whose weights the model learns"
    if offset:
        how = "non-negative values plus an offset the model learns as it is (PCEN's delta)"
    return (f"{hit.op}'s input went negative (as low as {hit.input_min:.3g}) as {how}, and "
            f"{said} {verb} negative entries (as initialised, or stepped below 0 by an "
            "update): keep them non-negative by construction (a reparameterization, GDN's "
            "NonNegativeParametrizer: a lower bound then w ** 2, or softplus(w), exp(w); "
            "mixture weights as softmax(logits)) "
            "rather than clamp the op's input, which would hide the sign")


def _call_output(runner: Runner, origin, module):
    """The output of ``origin``'s call of ``module``, re-run with autograd recording."""
    state = {"calls": 0, "out": None}

    def post(m, args, out):
        if runner.micro_batch != origin.micro_batch:
            return
        if state["calls"] == (origin.call or 0):
            state["out"] = out
            raise StopRun
        state["calls"] += 1

    runner.run(backward=False, instrument=False,
               hooks=lambda model: [module.register_forward_hook(post)])
    out = state["out"]
    return out if isinstance(out, torch.Tensor) else None


def _weights_under(out: torch.Tensor, domain: str, limit: int = 64):
    """The parameters with negative entries that weighted a non-negative input into the
    input of the first ``domain`` node on ``out``'s graph (breadth first, ``limit`` nodes),
    and whether it is one added to that input rather than weights."""
    todo, seen = [out.grad_fn], set()
    while todo and len(seen) < limit:
        fn = todo.pop(0)
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if node_op(fn) == domain:  # (past the views matmul's 2-D @ 3-D leaves after its mm)
            made = _through_views(fn.next_functions[0][0])
            if offset := _negative_offset(fn, made):
                return offset, True
            return _negative_weights(made), False
        todo.extend(f for f, _ in fn.next_functions)
    return [], False


def _negative_offset(fn, made) -> list[torch.Tensor]:
    """The parameter with negative entries that ``made``, an add, put onto values >= 0 to make
    the input ``fn`` saved (PCEN's ``(E / M ** alpha + delta) ** r`` with ``delta`` learned as
    is): the other addend, the input less the parameter, is read back from that input."""
    if made is None or node_op(made) != "Add":
        return []
    base = getattr(fn, "_saved_self", None)
    found = [p for f, _ in made.next_functions if (p := _param(f)) is not None
             and bool((p < 0).any())]
    if len(found) != 1 or not isinstance(base, torch.Tensor):
        return []
    try:
        rest = base.detach() - found[0].detach()
    except RuntimeError:  # (a parameter that does not broadcast to the input: viewed first)
        return []
    return found if bool((rest >= -1e-6 * rest.abs().max()).all()) else []


def _negative_weights(fn) -> list[torch.Tensor]:
    if fn is not None and node_op(fn) == "Sum":  # (an elementwise weighting, summed)
        return _summed_product(_through_views(fn.next_functions[0][0]))
    if fn is None or (spec := _PRODUCTS.get(node_op(fn))) is None:
        return []
    if spec[0] == "self":  # a product is x @ W or W @ x (a filterbank applied to a spectrum)
        return _weighted(fn, spec) or _weighted(fn, ("mat2", 1, (0,)))
    return _weighted(fn, spec)


def _weighted(fn, spec) -> list[torch.Tensor]:
    """The parameters with negative entries among ``fn``'s weight inputs, where its data
    input ``spec`` names is >= 0 and made by an op non-negative by its math, or off the graph
    into a product without a bias (a fixed power spectrum through a learned filterbank)."""
    try:
        data = getattr(fn, f"_saved_{spec[0]}")
    except AttributeError:
        return []
    made = _through_views(fn.next_functions[spec[1]][0])
    if not isinstance(data, torch.Tensor) or not bool((data >= 0).all()):
        return []
    # (data the graph does not keep, through a plain matrix product: only the weights can
    # take the sum below 0)
    off_graph = made is None and node_op(fn) in ("Mm", "Bmm")
    if not off_graph and (made is None or node_op(made) not in _NON_NEGATIVE):
        return []
    params = [_param(fn.next_functions[i][0]) for i in spec[2] if i < len(fn.next_functions)]
    return [p for p in params if p is not None and bool((p < 0).any())]


def _summed_product(fn) -> list[torch.Tensor]:
    """The parameter with negative entries that weighted values >= 0 by their math (exp, a
    square) elementwise before a sum: a mixture's ``(lp.exp() * w).sum(-1)``, its weights
    used as they are or normalised by a divisor (``w = weights / weights.sum()``)."""
    if fn is None or node_op(fn) != "Mul" or len(fn.next_functions) != 2:
        return []
    saved = (getattr(fn, "_saved_self", None), getattr(fn, "_saved_other", None))
    for i in (0, 1):
        data, made = saved[i], _through_views(fn.next_functions[i][0])
        if not isinstance(data, torch.Tensor) or made is None \
                or node_op(made) not in _NON_NEGATIVE or not bool((data >= 0).all()):
            continue
        weight = _through_views(fn.next_functions[1 - i][0])
        if weight is not None and node_op(weight) == "Div":  # (normalised by its sum)
            weight = weight.next_functions[0][0]
        p = _param(weight) if weight is not None else None
        if p is not None and bool((p < 0).any()):
            return [p]
    return []


def _through_views(fn, depth: int = 6):
    """The node that made a value, past the views and copies (``gamma.reshape``) after it."""
    for _ in range(depth):
        if fn is None or hasattr(fn, "variable") or node_op(fn) not in _VIEWS:
            return fn
        fn = fn.next_functions[0][0]
    return fn


def _param(fn) -> torch.Tensor | None:
    """The parameter a weight input comes from, as is or through views."""
    fn = _through_views(fn)
    return getattr(fn, "variable", None) if fn is not None else None
