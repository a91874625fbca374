"""An input event on a loss argument that holds no sample rows: a class-weight vector.

DeepCluster-style class balancing passes ``weight = 1 / counts`` (normalised, ``w / w.sum()``)
to ``F.cross_entropy`` through the loss: an empty cluster's count of 0 makes it inf, and the
normalisation NaN. Such a tensor has no batch dimension, so the event names no samples, and
the data-pipeline advice for "these samples" pointed nowhere. :func:`shared_loss_arg_hint`
says which entries hold the value and what makes such a vector non-finite.

A target with rows of the loss's own is no such vector: MixMatch's sharpened guesses, mixed up
and passed beside ``logits[:B]`` (the de-interleaved output's slice), have as many rows as
another loss argument and fewer than the model's batch. :func:`loss_rows_hint` names its rows,
and what makes a whole row of a normalised target NaN.
"""

from __future__ import annotations

from typing import Any

import torch

from recorder.capture import loss_path
from recorder.finite import kind_of, label
from recorder.samples import Samples

from .load import Step
from .memory_bank import bank_rows_hint

SHARED_LOSS_ARG = (
    "{tensor} (shape {shape}) is an argument of the loss with no row per sample, which every "
    "sample's loss takes, so no sample is to blame: it holds {kind} at index {at} of its "
    "{n} values. The loop made it (a per-class weight, a prior, a temperature): class weights "
    "1 / count with a class absent from the counts (an empty cluster) are 1/0, and "
    "normalising them (w / w.sum()) makes inf / inf, NaN; make it finite where it is made "
    "(count.clamp_min(1), a smoothing constant, a weight of 0 for an absent class)")
EVERY_VALUE = (
    ". Every one of its values is NaN, as a normalisation over the whole vector (a softmax, "
    "w / w.sum()) of one entry that was inf or NaN makes them: task weights made of ratios of "
    "earlier losses (DWA's softmax of L_t(e-1) / L_t(e-2), GradNorm's L_t / L_0) are x/0 or "
    "0/0 for a task whose loss was 0 (an epoch or first batch without a labelled sample for "
    "it); clamp the ratio's denominator (L.clamp_min(eps)) or leave such a task at weight 1")


LOSS_ROWS = (
    "{tensor} (shape {shape}) holds {kind} in its row(s) {rows} of {n}{whole}: rows of the "
    "loss's own, as many as {other}'s (shape {other_shape}), not the model's batch of {batch} "
    "(the loop sliced or rearranged the output: logits[:B] of an interleaved batch), so no "
    "sample of the batch is named. No data the model took was bad (its inputs were finite): "
    "the loop made this target (soft pseudo-labels, a sharpened guess p ** (1 / T) / sum, a "
    "mixup of targets); ")
WHOLE_ROWS = (
    "every entry of those rows is NaN, as a row normalised by a sum of 0 is (0/0): a "
    "sharpening power p ** (1 / T) of a small temperature underflows every class of an "
    "unsure row to 0, and a distribution made of counts or a mask can sum to 0; keep T away "
    "from 0, sharpen in log space (softmax(log(p) / T)) or clamp the sum (s.clamp_min(eps))")
SOME_ENTRIES = "check the code that computes it, and what it was computed from, for those rows"


def shared_loss_arg_hint(step: Step, origin: dict[str, Any], where: Samples) -> str | None:
    """The hint of an input event on loss argument ``origin["tensor"]`` when it names no
    samples and the tensor has no dimension of ``where``'s samples; None otherwise."""
    tensor = origin.get("tensor") or ""
    if not tensor.startswith("loss_") or origin.get("samples") or not step.micro_batches:
        return None
    mb = step.micro_batches[origin.get("micro_batch") or 0]
    args = {loss_path(raw): step.tensors.get(key) for key, raw in mb.get("loss_paths", {}).items()}
    t = args.get(tensor)
    if not isinstance(t, torch.Tensor) or t.dim() == 0 or not t.is_floating_point() \
            or where.dim(t) is not None:
        return None
    bad = (~torch.isfinite(t.detach())).nonzero()
    if not len(bad):
        return None
    if (rows := bank_rows_hint(tensor, t, args, where.size)
            or loss_rows_hint(tensor, t, args, where.size)) is not None:
        return rows
    at = ", ".join(str(tuple(i) if len(i) > 1 else i[0]) for i in bad[:5].tolist())
    more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
    every = EVERY_VALUE if t.numel() > 1 and bool(torch.isnan(t).all()) else ""
    return SHARED_LOSS_ARG.format(tensor=tensor, shape=tuple(t.shape), at=at + more,
                                  kind=label(kind_of(t)), n=t.numel()) + every


def loss_rows_hint(tensor: str, t: torch.Tensor, args: dict[str, Any], batch: int
                   ) -> str | None:
    """The hint for loss argument ``t`` of two or more dims whose rows are those of another
    loss argument (a target beside the logits it scores), when some rows hold its non-finite
    values; None for a vector, or a tensor whose rows nothing else shares (a cost matrix)."""
    if t.dim() < 2 or t.shape[0] < 2:
        return None
    other = next((name for name, a in args.items() if name != tensor
                  and isinstance(a, torch.Tensor) and a.dim() >= 1
                  and a.shape[0] == t.shape[0]), None)
    if other is None:
        return None
    bad = ~torch.isfinite(t.detach()).flatten(1)
    rows = bad.any(1).nonzero().flatten().tolist()
    whole = bool(torch.isnan(t).flatten(1)[rows].all()) and len(rows) < t.shape[0]
    text = LOSS_ROWS.format(tensor=tensor, shape=tuple(t.shape), kind=label(kind_of(t)),
                            rows=rows[:8] + (["..."] if len(rows) > 8 else []), n=t.shape[0],
                            whole=" (every entry of each)" if whole else "", other=other,
                            other_shape=tuple(args[other].shape), batch=batch)
    return text + (WHOLE_ROWS if whole else SOME_ENTRIES)
