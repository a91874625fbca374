"""An input event on a loss argument that holds no sample rows: a class-weight vector.

DeepCluster-style class balancing passes ``weight = 1 / counts`` (normalised, ``w / w.sum()``)
to ``F.cross_entropy`` through the loss: an empty cluster's count of 0 makes it inf, and the
normalisation NaN. Such a tensor has no batch dimension, so the event names no samples, and
the data-pipeline advice for "these samples" pointed nowhere. :func:`shared_loss_arg_hint`
says which entries hold the value and what makes such a vector non-finite.
"""

from __future__ import annotations

from typing import Any

import torch

from recorder.capture import loss_path
from recorder.finite import kind_of, label
from recorder.samples import Samples

from .load import Step

SHARED_LOSS_ARG = (
    "{tensor} (shape {shape}) is an argument of the loss with no row per sample, which every "
    "sample's loss takes, so no sample is to blame: it holds {kind} at index {at} of its "
    "{n} values. The loop made it (a per-class weight, a prior, a temperature): class weights "
    "1 / count with a class absent from the counts (an empty cluster) are 1/0, and "
    "normalising them (w / w.sum()) makes inf / inf, NaN; make it finite where it is made "
    "(count.clamp_min(1), a smoothing constant, a weight of 0 for an absent class)")


def shared_loss_arg_hint(step: Step, origin: dict[str, Any], where: Samples) -> str | None:
    """The hint of an input event on loss argument ``origin["tensor"]`` when it names no
    samples and the tensor has no dimension of ``where``'s samples; None otherwise."""
    tensor = origin.get("tensor") or ""
    if not tensor.startswith("loss_") or origin.get("samples") or not step.micro_batches:
        return None
    mb = step.micro_batches[origin.get("micro_batch") or 0]
    t = next((step.tensors.get(key) for key, raw in mb.get("loss_paths", {}).items()
              if loss_path(raw) == tensor), None)
    if not isinstance(t, torch.Tensor) or t.dim() == 0 or not t.is_floating_point() \
            or where.dim(t) is not None:
        return None
    bad = (~torch.isfinite(t.detach())).nonzero()
    if not len(bad):
        return None
    at = ", ".join(str(tuple(i) if len(i) > 1 else i[0]) for i in bad[:5].tolist())
    more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
    return SHARED_LOSS_ARG.format(tensor=tensor, shape=tuple(t.shape), at=at + more,
                                  kind=label(kind_of(t)), n=t.numel())
