"""An overflow of an op whose inputs were made of the batch's data alone, in some samples only.

PointNet++'s ``square_distance`` under float16 autocast computes ``-2 s·d`` by a matmul in
float16: a LiDAR sweep with ghost returns 300 m out (no point cloud range filter) makes
300² > 65504, +inf, while the other scenes' points, a few metres apart, fit. Nothing the model
learns reaches those inputs, so no learning rate drove them there (the precursors may still
show a warmup's learning-rate jump): the records named are out of the op's scale. A loss op on
the loss's data alone is :mod:`replay.data_overflow`'s. :data:`ADVICE` is what the hint adds
(from :mod:`replay.upstream`); :func:`said_of_data` tells ``replay.analyze`` not to add "the
run was diverging" after it.
"""

from __future__ import annotations

from typing import Any

import torch

# what ADVICE says of the op's inputs alone: the hint keeps it where the samples named are shown
# out of scale (replay.data_scale), whose sentence says the rest without the float32 escape
OF_DATA = ("; its inputs there were made of the batch's data alone (nothing the model learns "
           "reaches them)")

_DATA_ALONE = "its inputs there were made of the batch's data alone"
LOWER_LR = ", or lower the learning rate"  # (the op's own advice: cause_text's clamp_exp)

ADVICE = (
    "; but its inputs there were made of the batch's data alone (nothing the model learns reaches "
    "them), large in the samples named only: those records hold values out of the scale of "
    "the rest (points hundreds of metres out that a range filter should have cut, a value in "
    "another unit, a fill value), which no learning rate or weight drove there: crop or "
    "rescale such records where the data is made (the dataset, its transforms), or keep this "
    "op in float32")


def without_advice(hint: str) -> str:
    """``hint`` with :data:`ADVICE` cut to :data:`OF_DATA`: for a hint that goes on to name the
    samples whose data is out of scale, where ADVICE's generic records and its "or keep this
    op in float32" would repeat that sentence and contradict its "a wider type would only
    hide"."""
    return without_learning_rate(hint.replace(ADVICE, OF_DATA))


def without_learning_rate(hint: str) -> str:
    """``hint`` without the op's own ", or lower the learning rate" (``cause_text``'s clamp
    advice: exp's "clamp the exponent ..., or lower the learning rate") before its sentence
    that the op's inputs were the batch's data alone: nothing learned reaches them, so no
    learning rate drove them there (an exponential time surface's ``exp(t / tau)`` of
    timestamps left in microseconds)."""
    at = hint.find(_DATA_ALONE)
    head = hint[:at].rpartition(LOWER_LR)
    if at < 0 or not head[1]:
        return hint
    return head[0] + head[2] + hint[at:]


def data_alone_hint(report: dict[str, Any], step: Any = None) -> None:
    """Cut the learning-rate advice an overflow's hint gives before it says the op's inputs
    were the batch's data alone (:func:`without_learning_rate`)."""
    if report.get("cause") == "overflow" and report.get("hint"):
        report["hint"] = without_learning_rate(report["hint"])


def unlearned(lineage, ins: list[torch.Tensor], rows: list[int] | None, where) -> bool:
    """An op of the forward under autograd went non-finite in some of the batch's samples
    (``where``), and none of its floating inputs is learned: none requires grad, and
    ``lineage`` saw no weight make it (a ``.detach()``'d or ``no_grad`` value of the weights
    is learned too)."""
    floats = [t for t in ins if t.is_floating_point()]
    if lineage is None or not where or not torch.is_grad_enabled() or not floats \
            or not rows or len(rows) >= where.size:
        return False
    return not any(t.requires_grad or t in lineage.learned for t in floats)


def said_of_data(report: dict[str, Any]) -> bool:
    """The report's hint blames the records' scale (:data:`ADVICE`), not the training."""
    return ADVICE in (report.get("hint") or "")
