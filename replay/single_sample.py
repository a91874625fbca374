"""A loss made non-finite by a micro-batch of one sample: finite with that sample given twice.

InfoLOOB (CLOOB) divides each positive pair by the sum over the batch's other samples; a
contrastive loss's negatives and a leave-one-out mean are sums of the same kind; a share of
the batch rounded down (Co-teaching's ``int(remember_rate * n)`` small-loss samples) is a
count of the same kind. A ``DataLoader``'s last batch (``drop_last=False``) of one record
leaves that sum or count empty, 0, and the division's advice (an eps in the denominator)
would hide a loss with nothing to compare. The loss is re-run on the re-computed outputs and
the recorded loss arguments with every tensor of one row given twice: finite there, the
batch of one is why.
"""

from __future__ import annotations

from typing import Any

import torch

from .compat import tree_map
from .load import Step, autocast_as_recorded, loss_inputs
from .rerun import Runner


def _twice(v):
    return torch.cat([v, v]) if isinstance(v, torch.Tensor) and v.dim() and len(v) == 1 else v


def single_sample_hint(report: dict[str, Any], step: Step) -> None:
    """Add to an invalid loss origin's hint, in a micro-batch of one sample, that the loss is
    finite when that sample is given twice (the sample alone is no fault of its data)."""
    o = report["origin"]
    if report.get("cause") != "invalid" or o.get("phase") != "loss" \
            or o.get("module") != "<loss>" or o.get("batch_size") != 1 \
            or step.model is None or step.loss_fn is None:
        return
    mb = o.get("micro_batch") or 0
    try:
        run = Runner(step).run(backward=False, instrument=False)
        outs = [[t.detach() for t in out] for out in run.outputs]
        args, kwargs = tree_map(_twice, loss_inputs(step, mb, outs, objects=run.objects))
        with torch.no_grad(), autocast_as_recorded(step.micro_batches[mb], step.device,
                                                   loss=True):
            loss = step.loss_fn(*args, **kwargs)
    except Exception:  # (the op's own advice stands)
        return
    if not isinstance(loss, torch.Tensor) or not bool(torch.isfinite(loss).all()):
        return
    report["hint"] = (report.get("hint") or "") + (
        "; but the micro-batch holds 1 sample, and the loss is finite on that sample given "
        "twice: the 0 comes from the batch's size, not an eps missing: a sum over the "
        "batch's other samples (InfoLOOB's or a contrastive loss's negatives, a leave-one-out "
        "mean) or a share of the batch rounded down (Co-teaching's int(remember_rate * n) "
        "small-loss samples, a top-k), empty in a batch of one: drop the last incomplete "
        "batch (DataLoader(..., drop_last=True)) or skip batches of one sample (a share: keep "
        "at least one, max(1, int(rate * n)))")
