"""A probability given as data, at 0 or 1, where it divides.

A DR-learner's pseudo-outcome ``(t - e) / (e * (1 - e))``, an IPW loss's ``t / e`` take the
propensity ``e`` a first-stage classifier made: data to the loss, in [0, 1]. A tree ensemble's
``predict_proba`` is exactly 0 or 1 in a pure leaf, and the division is 0/0 there. The
op on data alone reads as a degenerate record ("an eps would train toward a made-up target"),
but such a probability is trimmed by design (causalml's ``trim_eps``, econml's
``min_propensity``): the hint says so, naming the tensor. A tensor of 0s and 1s only (the
treatment itself, a mask) is no probability, so it is not named.
"""

from __future__ import annotations

from typing import Any

import torch

from recorder.capture import loss_path

from .load import Step
from .recorded import samples

_DIVIDING = {"aten.div", "aten.div_", "aten.reciprocal"}
OF_DATA = "what it took there was computed from the batch's data alone"


def data_division_rows(report: dict[str, Any]) -> tuple[list[int], str] | None:
    """(the samples, the hint) of an ``invalid`` division of the data alone whose hint gives
    the degenerate-record advice (:data:`OF_DATA`) for some of the batch's samples; else None:
    what a hint naming the tensor that divided there (a probability at 0 or 1, a target with
    no mass) replaces."""
    o, hint = report["origin"], report.get("hint") or ""
    rows = o.get("samples") or []
    if report.get("cause") != "invalid" or o.get("op") not in _DIVIDING or not rows \
            or OF_DATA not in hint or o.get("all_samples"):
        return None
    return rows, hint


def edge_probability_hint(report: dict[str, Any], step: Step) -> None:
    """Replace an ``invalid`` division's degenerate-record advice (:func:`data_division_rows`)
    when a probability of the micro-batch (:func:`_at_edge`) is 0 or 1 at every named
    sample."""
    if (found := data_division_rows(report)) is None:
        return
    rows, hint = found
    name = _at_edge(step, report["origin"].get("micro_batch") or 0, rows)
    if name is not None:
        which = ",".join(str(r) for r in rows)
        report["hint"] = (
            hint[:hint.index(OF_DATA)] + f"{OF_DATA}, and {name}, a probability (its values "
            f"lie in [0, 1]), is exactly 0 or 1 at sample(s) {which}: a propensity score or "
            "an importance probability from a classifier (a tree's pure leaf predicts 0 or 1) "
            "divides as e, 1 − e or e·(1 − e) only kept off 0 and 1: trim it where it is "
            "made or before the division, e.clamp(0.01, 0.99) (causalml's trim_eps, econml's "
            "min_propensity), or drop the samples outside the overlap (where positivity "
            "fails)")


def _at_edge(step: Step, mb: int, rows: list[int]) -> str | None:
    """The readable name of the first floating loss argument of micro-batch ``mb`` holding one
    number per sample, values in [0, 1], some strictly inside, and 0 or 1 in every element of
    ``rows``; None when there is none. (A loss argument: what a loss on data alone divides
    by; a propensity the model takes is the model's input, not divided in the loss.)"""
    if mb >= len(step.micro_batches):
        return None
    entry, where = step.micro_batches[mb], samples(step, mb)
    for key, raw in (entry.get("loss_paths") or {}).items():
        t = step.tensors.get(key)
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or not t.numel():
            continue
        d = where.dim(t)  # (one number per sample: a heatmap or soft mask is no propensity)
        if d is None or t.numel() != t.shape[d] or max(rows) >= t.numel() \
                or not bool(((t >= 0) & (t <= 1)).all()):
            continue
        inside = (t > 0) & (t < 1)
        if bool(inside.any()) and not bool(inside.movedim(d, 0)[rows].any()):
            return loss_path(raw)
    return None
