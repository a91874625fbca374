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


def name_divided_data(report: dict[str, Any], step: Step, find, says) -> None:
    """Replace the degenerate-record advice (:data:`OF_DATA`) of an ``invalid`` division of
    the data alone, for some of the batch's samples, when ``find(step, micro_batch, rows)``
    names the loss argument that divided there (a probability at 0 or 1, a target with no
    mass): the hint goes on with ``says(which)``, after that name."""
    o, hint = report["origin"], report.get("hint") or ""
    rows = o.get("samples") or []
    if report.get("cause") != "invalid" or o.get("op") not in _DIVIDING or not rows \
            or OF_DATA not in hint or o.get("all_samples"):
        return
    name = find(step, o.get("micro_batch") or 0, rows)
    if name is not None:
        which = ",".join(str(r) for r in rows)
        report["hint"] = hint[:hint.index(OF_DATA)] + f"{OF_DATA}, and {name}, {says(which)}"


def loss_args_by_sample(step: Step, mb: int):
    """(readable path, tensor, its sample dimension) of each non-empty floating loss argument
    of micro-batch ``mb`` whose samples the bundle locates."""
    if mb >= len(step.micro_batches):
        return
    entry, where = step.micro_batches[mb], samples(step, mb)
    for key, raw in (entry.get("loss_paths") or {}).items():
        t = step.tensors.get(key)
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() \
                and (d := where.dim(t)) is not None:
            yield loss_path(raw), t, d


def edge_probability_hint(report: dict[str, Any], step: Step) -> None:
    """Replace an ``invalid`` division's degenerate-record advice (:func:`name_divided_data`)
    when a probability of the micro-batch (:func:`_at_edge`) is 0 or 1 at every named
    sample."""
    name_divided_data(report, step, _at_edge, lambda which: (
        f"a probability (its values lie in [0, 1]), is exactly 0 or 1 at sample(s) {which}: a "
        "propensity score or an importance probability from a classifier (a tree's pure leaf "
        "predicts 0 or 1) divides as e, 1 − e or e·(1 − e) only kept off 0 and 1: trim it "
        "where it is made or before the division, e.clamp(0.01, 0.99) (causalml's trim_eps, "
        "econml's min_propensity), or drop the samples outside the overlap (where positivity "
        "fails)"))


def _at_edge(step: Step, mb: int, rows: list[int]) -> str | None:
    """The readable name of the first floating loss argument of micro-batch ``mb`` holding one
    number per sample, values in [0, 1], some strictly inside, and 0 or 1 in every element of
    ``rows``; None when there is none. (A loss argument: what a loss on data alone divides
    by; a propensity the model takes is the model's input, not divided in the loss.)"""
    # (one number per sample: a heatmap or soft mask is no propensity)
    for name, t, d in loss_args_by_sample(step, mb):
        if t.numel() != t.shape[d] or max(rows) >= t.numel() \
                or not bool(((t >= 0) & (t <= 1)).all()):
            continue
        inside = (t > 0) & (t < 1)
        if bool(inside.any()) and not bool(inside.movedim(d, 0)[rows].any()):
            return name
    return None
