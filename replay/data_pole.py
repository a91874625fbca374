"""A log's or root's argument outside its domain that the batch itself holds at the samples
named: a missing-value code, not a value the model computed.

Tabular and click-through-rate pipelines fill a missing count with -1 (``fillna(-1)``) and the
model log1p's the counts in forward: log1p(-1) is -inf, and BatchNorm's batch mean spreads it
to every row. The op's own advice (keep the input above -1, ``x.clamp_min(-1 + eps)``) turns
the code into an extreme feature, log(eps). When a batch tensor holds a value at or below the
op's pole in exactly the samples named, and the op's smallest input is that very value, the
hint says the data holds it and to impute it where the data is made.

A loss argument the batch gave (a target, not one the loop made of the model's output) is
read the same way: a negative count or price under a mean squared log error's
``log1p(target)``, a soft label's negative probability under ``KLDivLoss``'s
``xlogy(target, target)``. The op's own advice for data (a degenerate record, a target of 0
to mask) is then replaced by the target's value and the loss's domain: a target outside it is
dropped or masked, never clamped (a clamp trains toward a made-up target).
"""

from __future__ import annotations

from typing import Any

import torch

from recorder.capture import batch_path, loss_path

from .cause_text import DO
from .domains import g
from .load import Step
from .log_domain import ADVICE as LOG_DOMAIN
from .log_domain import CLAMP
from .loss_arg_name import with_param_name
from .recorded import n_args, samples

# the ops and the largest value outside their domain (or at their pole): log's 0 is a real
# count of 0 (the log-of-0 advice stands there); a count is never -1 nor below 0
_EDGE = {"log1p": -1.0, "log": -1e-30, "log2": -1e-30, "log10": -1e-30, "sqrt": -1e-30,
         "xlogy": -1e-30}
# (what each takes, for a loss target outside it; xlogy(t, t): KLDivLoss's t * log(t))
_DOMAIN = {"log1p": "log1p takes values above -1", "sqrt": "sqrt takes values of 0 or more",
           "xlogy": "xlogy(t, t), t * log(t), takes values of 0 or more"}
# the op's advice for a value computed from data alone, which the target's own replaces
_OF_DATA = tuple(", which exact arithmetic makes too: " + DO[k] for k in ("compared", "of_data"))

AS_GIVEN = "as the batch gave it"  # (what replay.negative_rows defers to)


def nines_code(values: torch.Tensor) -> float | None:
    """The one value ``values`` all hold when it is a run of nines, ``±(10^k - 1)`` with
    k >= 1 (-99, 99, -999, -9999: the missing-value codes of catalogues and surveys, a band not
    observed), else None."""
    if not values.numel() or bool((values != values.flatten()[0]).any()):
        return None
    v = abs(float(values.flatten()[0]))
    return float(values.flatten()[0]) if v >= 9 and str(int(v)) == "9" * len(str(int(v))) \
        and v == int(v) else None


def _measured(values: torch.Tensor) -> bool:
    """Whether the out-of-domain values are no code: not whole numbers (a background-
    subtracted flux of -0.2, a difference of noisy counts)."""
    return bool((values != values.round()).any())


def _what(bad: torch.Tensor) -> str:
    if _measured(bad):
        return ("a measurement that noise or an offset took below the op's domain (a "
                "sky-subtracted flux of a faint source, a difference of noisy counts), no "
                "corrupt record: a clamp or dropping those records biases toward the bright "
                "ones; use a transform defined there (asinh magnitudes, a signed log "
                "sign(x) * log1p(|x|)) or keep such values as upper limits where the data "
                "is made")
    return ("a code for a missing value (fillna(-1)) or a corrupt record, which a clamp "
            "would turn into an extreme feature; impute it where the data is made (a "
            "default such as 0, with a missing-indicator column) or drop those records")


def _target_what(op: str, bad: torch.Tensor) -> str:
    """What a loss argument's value outside the op's domain is, and what to do."""
    domain = _DOMAIN.get(op, f"{op} takes positive values")
    if _measured(bad):
        what = ("a target the data gives outside what the loss takes (a soft label whose "
                "probabilities label arithmetic took below 0: a smoothing, a mixup, a stacked "
                "augmentation's 1 - p - s; a price or count a correction took below 0): drop or "
                "repair such records where the data is made, or use a loss defined there (MSE "
                "or Huber of the raw values, a signed log sign(y) * log1p(|y|) on both sides)")
    else:
        what = ("a code for a missing target (-1, fillna(-1)) or a corrupt record: drop or "
                "repair such records where the data is made, or leave them out of the loss "
                "with a mask of the valid targets")
    return (f"{domain} only, so the loss is undefined on this target: {what}; "
            "a clamp or an eps in the loss would train toward a made-up target")


def _data_tensors(step: Step, mb: dict):
    """(bundle key, readable name, whether a loss argument) of micro-batch ``mb``'s data:
    model inputs, then loss arguments the batch gave (not those made of the model output)."""
    for key, raw in (mb.get("paths") or {}).items():
        yield key, batch_path(raw, n_args(mb.get("inputs"))), False
    made = set(mb.get("loss_grad_args") or ())
    for key, raw in (mb.get("loss_paths") or {}).items():
        if key not in made:
            yield key, with_param_name(loss_path(raw), step.loss_fn), True


def data_pole_hint(report: dict[str, Any], step: Step) -> None:
    """Append to an invalid log's or root's hint the data tensor holding its bad value."""
    o = report.get("origin") or {}
    op = (o.get("op") or "").removeprefix("aten.").rstrip("_")
    edge = _EDGE.get(op)
    # (a loss origin has no input_range: its chain's first op, the origin's, has the min)
    head = (o.get("chain") or [{}])[0]
    low = (o.get("input_range") or [head.get("input_min") if head.get("op") == o.get("op")
                                    else None])[0]
    rows = o.get("samples") or []
    if report.get("cause") != "invalid" or edge is None or low is None or low > edge \
            or not rows or o.get("all_samples") or not report.get("hint"):
        return
    i = o.get("micro_batch") or 0
    mb = step.micro_batches[i] if i < len(step.micro_batches) else {}
    at = samples(step, i)
    for key, name, target in _data_tensors(step, mb):
        t = step.tensors.get(key)
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() < 1:
            continue
        # (a time-major target, (T, B): its rows are the samples' dimension's)
        d = at.dim(t) or 0
        bad = (t <= edge).movedim(d, 0).reshape(t.shape[d], -1)
        hit = torch.nonzero(bad.any(1)).flatten().tolist()
        if hit != rows or float(t.min()) != low:
            continue
        one = t.dim() == 2 and t.shape[1] == 1 and target  # (a (B, 1) target: no column)
        cols = sorted(set(torch.nonzero(bad)[:, 1].tolist())) \
            if t.dim() == 2 and d == 0 and not one else []
        where = f" (column {', '.join(map(str, cols))})" if cols else ""
        # (no constraint's slack: the batch's own value, no iterate a step took outside)
        hint = report["hint"].replace(LOG_DOMAIN, CLAMP)
        said = hint
        if target:  # (the target's value and the loss's domain say what the advice guessed)
            for advice in _OF_DATA:
                hint = hint.replace(advice, "")
        report["hint"] = (
            f"{hint}{': ' if hint != said else '. But '}{name} holds {g(low)} at sample(s) "
            f"{', '.join(map(str, rows))}{where} {AS_GIVEN}, the value the op took: "
            + (_target_what(op, t[t <= edge]) if target else _what(t[t <= edge])))
        return
