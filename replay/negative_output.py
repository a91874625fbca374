"""Where in the model a negative value the loss took out of its domain was made.

A mean-scale hyperprior whose ``GaussianConditional`` lost both bounds returns likelihoods
``upper - lower`` that are negative where a predicted scale is; the rate term's
``torch.log(likelihoods)`` is NaN there. The loss's op is named, but the hint (clamp the op's
input into its domain) points at the loss, while the value that cannot be negative (a
likelihood, a variance, a norm) came out of the model so. :func:`negative_output_hint` adds
which model output it is, which module returned it and which op made it, read from one
re-run of the forward (only for such an op: an invalid log, sqrt or power of a negative);
so it does for a likelihood that underflowed to 0 (``upper - lower`` of two CDF tails with
the likelihood's lower bound removed), to bound where it is made. A 0 the model wrote as a
constant (an extended vocabulary's unfilled slot) is named by :mod:`replay.unfilled`. An
exact 0 a ReLU-like cut made (deep evidential regression's ``nu = relu(.)`` under
``log(pi / nu)``) is named too: non-negative is not enough for a divisor or a log; so is a
normaliser's 0/0 (DM-Count's ``pred / pred.sum()``) of samples whose whole output such a cut
made 0 (a dead ReLU density head).
"""

from __future__ import annotations

from typing import Any

import torch

from recorder.scripted import hookable_modules

from .positive import POSITIVE, node_op
from .rerun import Runner
from .unfilled import unfilled_hint

_DOMAIN = {"aten.log", "aten.log2", "aten.log10", "aten.sqrt", "aten.rsqrt", "aten.pow",
           "aten.log1p"}
# one-input ops with a pole at 0, and the ops that cut their input to exactly 0 there
_POLES = {"aten.log", "aten.log2", "aten.log10", "aten.rsqrt", "aten.reciprocal"}
_CUTS = {"aten.relu", "aten.threshold", "aten.clampmin", "aten.clamp", "aten.hardtanh"}
_DIVIDES = {"aten.div", "aten.div_"}
# the openings of the sentences saying that the op's input is a model output as returned (its
# 0s, its negative values): no statistic of it, no bound in the data (replay.constant_output,
# replay.zero_bound)
ZEROS_MADE, NEGATIVES_MADE = "The 0s are the model's ", "The negative values are the model's "


def negative_output_hint(runner: Runner, mb: int, hit, cause: str, hint: str | None
                         ) -> str | None:
    """``hint`` with where the model made the negative input of the loss's ``hit`` (or, for
    an underflow, its 0), when that input is one model output as returned (the one output
    whose least value is the op's input's); for an invalid 0, the constant it wrote."""
    if (unfilled := unfilled_hint(runner, mb, hit, cause, hint)) is not hint:
        return unfilled
    if hit is not None and hint is not None and runner.model is not None \
            and cause == "invalid" and hit.input_min == 0 and hit.op in _DIVIDES and hit.rows:
        return _dead_rows_hint(runner, mb, hit, hint)
    if hit is None or hit.op not in _DOMAIN | _POLES or hint is None \
            or hit.input_min is None or runner.model is None:
        return hint
    cut = cause == "invalid" and hit.input_min == 0 and hit.op in _POLES
    if not (cause == "invalid" and hit.input_min < 0 and hit.op in _DOMAIN) and not cut \
            and not (cause == "underflow" and hit.input_min == 0 and hit.op in _DOMAIN):
        return hint
    # (an underflow's 0 is the least value of many outputs, a warped one-hot label map's: the
    # op's input is the output as returned only where its largest value is that output's too)
    most = hit.input_max if cause == "underflow" else None
    try:
        found = _made_in(runner, mb, hit.input_min, most)
    except Exception:  # (a model the extra re-run cannot take: the hint as it was)
        return hint
    if found is None:
        return hint
    path, module, op, _ = found
    if cause == "underflow" and (op is None or op.removeprefix("aten.") in POSITIVE):
        return hint  # (a softmax or exp output: the hint's log-space advice is the fix)
    who = f"module {module}" if module else "the model's forward"
    made = f", made by {op}" if op else ""
    if cut:
        if op not in _CUTS:
            return hint
        return (f"{hint}. {ZEROS_MADE}{path}, which {who} returned{made}, exactly 0 "
                "wherever its input is negative: non-negative is not enough for a divisor or a "
                "log; bound it below where it is made (softplus(x) + eps, or exp of a learned "
                "log), which an eps in the loss would only patch")
    if cause == "underflow":
        return (f"{hint}. {ZEROS_MADE}{path}, which {who} returned{made}: bound it "
                "where it is made (a likelihood's lower bound, clamp_min(1e-9) in that "
                "module), so every use of it gets the bounded value")
    return (f"{hint}. {NEGATIVES_MADE}{path}, which {who} returned"
            f"{made}: a value that must not be negative there (a likelihood, a variance, a "
            "scale) came out of the model so; fix it where it is made (bound or "
            "reparameterize what makes it negative), as a clamp in the loss would hide it")


def _dead_rows_hint(runner: Runner, mb: int, hit, hint: str) -> str:
    """``hint`` with the model output a cut made 0 in every entry of each sample the 0/0
    division names (its sum, a normaliser, is 0 there: not the data's, a dead head's)."""
    try:
        found = _made_in(runner, mb, 0.0)
    except Exception:  # (a model the extra re-run cannot take: the hint as it was)
        return hint
    if found is None or found[2] not in _CUTS:
        return hint
    path, module, op, t = found
    rows = [r for r in hit.rows if 0 <= r < t.shape[0]]
    if t.dim() < 2 or len(rows) != len(hit.rows) or bool(t.detach()[rows].any()):
        return hint
    who = f"module {module}" if module else "the model's forward"
    return (f"{hint}. The 0s are the model's {path}, which {who} returned, made by {op}: it "
            f"is 0 in every entry of sample(s) {rows[:8]}, so a sum of it (a normaliser) is 0 "
            "there; the cut is dead for them (every input below 0: a negative bias, a step "
            "too large) and passes no gradient to revive it. Keep an eps in the normaliser "
            "(x.sum() + 1e-6) and bound the output where it is made (softplus, or a head "
            "initialised to positive outputs)")


def _made_in(runner: Runner, mb: int, least: float, most: float | None = None
             ) -> tuple[str, str, str | None, torch.Tensor] | None:
    """(the output's path, the innermost module returning it, the op that made it, the
    output) of the model output of micro-batch ``mb`` whose least value is ``least`` (and
    largest ``most``, unless None)."""
    calls: list[tuple[str, Any]] = []
    names = {m: n for n, m in runner.model.named_modules()}

    def post(m, args, out):
        if runner.micro_batch == mb:
            calls.append((names.get(m, ""), out))

    runner.run(backward=False, instrument=False,
               hooks=lambda model: [m.register_forward_hook(post)
                                    for _, m in hookable_modules(model)])
    root = next((out for n, out in reversed(calls) if n == ""), None)
    hits = [(path, t) for path, t in _paths(root, "output")
            if t.is_floating_point() and t.numel() and float(t.detach().min()) == least
            and (most is None or float(t.detach().max()) == most)]
    if len(hits) != 1:  # (none, or several outputs it could be: say nothing)
        return None
    path, t = hits[0]
    module = next((n for n, out in calls if n and any(u is t for u in _tensors(out))), "")
    return path, module, _op(t), t


def _op(t: torch.Tensor) -> str | None:
    fn = t.grad_fn
    return f"aten.{node_op(fn).lower()}" if fn is not None and "Backward" in fn.name() \
        else None


def _paths(obj, at: str):
    """(path, tensor) of each tensor in a nested output (``output['likelihoods']['y']``)."""
    if isinstance(obj, torch.Tensor):
        yield at, obj
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _paths(v, f"{at}[{i}]")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, f"{at}[{k!r}]")


def _tensors(out) -> list[torch.Tensor]:
    return [t for _, t in _paths(out, "")]
