"""A log of a negative number where the batch holds a 0, in exactly the samples named, in a
quantity that is positive everywhere else: a bound missing from the record.

An interior-point log barrier ``-mu * log(b - g(x))`` keeps a flow, a temperature or a state
of charge inside a limit ``b`` that the data gives per record (a line's dynamic rating, a
reservoir's capacity, a battery's power limit). A record whose limit was missing and filled
with 0 (``fillna(0)``) has no feasible point: its slack ``0 - g(x)`` is negative whatever the
model predicts, and the log is NaN there. The log-domain advice (start feasible, keep the
steps inside) cannot help; the data can. When the origin is such a log and a floating model
input or loss argument that is data (not made of the model output) is positive everywhere but
0 at entries of exactly the samples named (each of them holding one), the hint names that
tensor and its entries and says to repair the bound or leave its constraint out there. Not
when the log's negative input is a model output as returned (``replay.negative_output`` named
it: ``PoissonNLLLoss(log_input=False)``'s log of a raw rate), where a 0 count in the target
is data the log never took.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from recorder.capture import loss_path
from recorder.finite import zero_one

from .domains import g
from .empty_counts import root_inputs
from .load import Step
from .log_domain import ADVICE as LOG_DOMAIN
from .negative_output import NEGATIVES_MADE
from .recorded import samples

_LOGS = {"aten.log", "aten.log2", "aten.log10"}


def zero_bound_hint(report: dict[str, Any], step: Step) -> None:
    """Append to a log-of-a-negative hint the batch data holding a bound of 0 there."""
    o, hint = report.get("origin") or {}, report.get("hint") or ""
    rows, mb = o.get("samples") or [], o.get("micro_batch") or 0
    low = (o.get("input_range") or [(o.get("chain") or [{}])[0].get("input_min")])[0]
    if report.get("cause") != "invalid" or o.get("op") not in _LOGS or low is None \
            or low >= 0 or not rows or o.get("all_samples") or LOG_DOMAIN not in hint \
            or NEGATIVES_MADE in hint:  # (the log took a model output as is: no slack)
        return
    for name, t, d in _data(step, mb):
        at = _zero_bound(t, d, rows)
        if at is None:
            continue
        shown = ", ".join(str(tuple(i)) if len(i) > 1 else str(i[0]) for i in at[:4].tolist())
        more = f" (+{len(at) - 4})" if len(at) > 4 else ""
        report["hint"] = (
            f"{hint}. But {name} is 0 at {shown}{more} in the samples named and positive "
            f"everywhere else (its smallest other value {g(float(t[t > 0].min()))}): a limit "
            "the record gives (a rating, a capacity, a bound) missing and filled with 0, "
            "which leaves those records no feasible point, so the slack b - g(x) is negative "
            "whatever the model predicts; repair the bound where the data is made (its "
            "nominal value) or leave the constraint's term out where it is missing (mask "
            "it), rather than clamping the slack")
        return


def _data(step: Step, mb: int) -> Iterator[tuple[str, torch.Tensor, int]]:
    """(readable name, tensor, sample dim): the floating model inputs, then the loss's
    arguments that are data (not made of the model output)."""
    yield from root_inputs(step, mb)
    if mb >= len(step.micro_batches):
        return
    entry, where = step.micro_batches[mb], samples(step, mb)
    made = set(entry.get("loss_grad_args") or ())
    for key, raw in (entry.get("loss_paths") or {}).items():
        t = step.tensors.get(key)
        if key not in made and isinstance(t, torch.Tensor) and t.is_floating_point() \
                and t.numel() and (d := where.dim(t)) is not None:
            yield loss_path(raw), t, d


def _zero_bound(t: torch.Tensor, d: int, rows: list[int]) -> torch.Tensor | None:
    """The indices of ``t``'s 0s (samples along dim 0) when ``t`` is positive elsewhere, not
    0/1, and holds a 0 in each of ``rows`` and in no other sample; else None."""
    t = t.detach().movedim(d, 0)
    if max(rows) >= t.shape[0] or len(rows) >= t.shape[0] or zero_one(t) \
            or bool((t < 0).any()) or not bool(torch.isfinite(t).all()):
        return None
    zero = t == 0
    per_row = zero.reshape(t.shape[0], -1).any(1)
    named = torch.zeros_like(per_row)
    named[rows] = True
    if not bool(per_row[named].all()) or bool(per_row[~named].any()) \
            or bool(zero.reshape(t.shape[0], -1)[named].all()):
        return None  # (a record all 0 is a blank one: replay.zero_records)
    return torch.nonzero(zero)
