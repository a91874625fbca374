"""A loss made non-finite by a micro-batch of one sample: finite with that sample given twice.

InfoLOOB (CLOOB) divides each positive pair by the sum over the batch's other samples; a
contrastive loss's negatives and a leave-one-out mean are sums of the same kind; a share of
the batch rounded down (Co-teaching's ``int(remember_rate * n)`` small-loss samples) is a
count of the same kind. A ``DataLoader``'s last batch (``drop_last=False``) of one record
leaves that sum or count empty, 0, and the division's advice (an eps in the denominator)
would hide a loss with nothing to compare. The loss is re-run on the re-computed outputs and
the recorded loss arguments with every tensor of one row given twice: finite there, the
batch of one is why. A statistic over the batch (a Pearson or concordance correlation's
variance, a std over the samples) is 0 over copies of one sample too: where the loss (of a
backward event, its gradient: Pearson's ``sqrt(vx)`` with the eps after the root) is finite
only beside a second, different sample (the copy's float values halved), that is the reason.
An unbiased ``std`` or ``var`` over the batch (a batch norm written by hand, as makemore's
lecture writes ``x.var(0)``; ProGAN's minibatch-std layer in a discriminator the generator's
loss runs; REINFORCE's returns normalised by their std, over an episode of one step) is NaN
over one sample and finite over two copies: named as the
batch's spread, not as a sum over the other samples; so is one the model's own forward takes
(that discriminator recorded itself), when its output is finite with the batch's tensors
holding the one sample twice.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .compat import tree_map
from .load import Step, autocast_as_recorded, loss_inputs
from .rerun import Runner

# reductions with a correction (Bessel's n - 1): over one sample a division by 0
CORRECTED = {"aten.std", "aten.var", "aten.std_mean", "aten.var_mean"}


def _twice(v, scale: float = 1.0):
    if not (isinstance(v, torch.Tensor) and v.dim() and len(v) == 1):
        return v
    return torch.cat([v, v * scale if v.is_floating_point() else v])


def _finite_on_two(step: Step, mb: int, run, scale: float, grads: bool) -> bool:
    """The loss (and, with ``grads``, its gradient w.r.t. the model outputs) is finite on the
    micro-batch's one sample given twice, the second copy's float values times ``scale``."""
    outs = [[t.detach().requires_grad_(grads and t.is_floating_point()) for t in out]
            for out in run.outputs]
    args, kwargs = tree_map(lambda v: _twice(v, scale),
                            loss_inputs(step, mb, outs, objects=run.objects))
    with torch.set_grad_enabled(grads), \
            autocast_as_recorded(step.micro_batches[mb], step.device, loss=True):
        loss = step.loss_fn(*args, **kwargs)
    if not isinstance(loss, torch.Tensor) or not bool(torch.isfinite(loss).all()):
        return False
    leaves = [t for out in outs for t in out if t.requires_grad]
    if not grads or not leaves or not loss.requires_grad:
        return True
    got = torch.autograd.grad(loss.float().sum(), leaves, allow_unused=True)
    return all(g is None or bool(torch.isfinite(g).all()) for g in got)


def single_sample_hint(report: dict[str, Any], step: Step) -> None:
    """Add to an invalid loss origin's hint (a loss op's, or a backward node's of the loss), in
    a micro-batch of one sample, that the loss is finite when that sample is given twice (the
    sample alone is no fault of its data), or else beside a second, different sample (a
    statistic over the batch, 0 over one sample and over copies of it)."""
    o = report["origin"]
    backward = o.get("phase") == "backward"
    if o.get("phase") == "forward":
        return _forward_spread(report, step)
    if report.get("cause") != "invalid" or o.get("phase") not in ("loss", "backward") \
            or o.get("module") != "<loss>" or o.get("batch_size") != 1 \
            or step.model is None or step.loss_fn is None:
        return
    mb = o.get("micro_batch") or 0
    try:
        run = Runner(step).run(backward=False, instrument=False)
        same = _finite_on_two(step, mb, run, 1.0, backward)
        varied = not same and _finite_on_two(step, mb, run, 0.5, backward)
    except Exception:  # (the op's own advice stands)
        return
    if varied:
        what = "loss's gradient" if backward else "loss"
        report["hint"] = (report.get("hint") or "") + (
            f"; but the micro-batch holds 1 sample, and the {what} is finite beside a second, different sample (its values halved), not on "
            "that sample given twice: a statistic over the batch's samples (a variance or "
            "std over the batch, a Pearson or concordance correlation's spread, a batch "
            "normalisation) is 0 over one sample, which no eps makes a statistic: drop the "
            "last incomplete batch (DataLoader(..., drop_last=True)) or skip batches of fewer "
            "than 2 samples")
    if not same:
        return
    if o.get("op") in CORRECTED:  # (given twice, its n - 1 is 1: the reduction is the batch's)
        report["hint"] = (report.get("hint") or "") + _spread_text(o["op"], "loss")
        return
    report["hint"] = (report.get("hint") or "") + (
        "; but the micro-batch holds 1 sample, and the loss is finite on that sample given "
        "twice: the 0 comes from the batch's size, not an eps missing: a sum over the "
        "batch's other samples (InfoLOOB's or a contrastive loss's negatives, a leave-one-out "
        "mean) or a share of the batch rounded down (Co-teaching's int(remember_rate * n) "
        "small-loss samples, a top-k), empty in a batch of one: drop the last incomplete "
        "batch (DataLoader(..., drop_last=True)) or skip batches of one sample (a share: keep "
        "at least one, max(1, int(rate * n)))")


def _spread_text(op: str, what: str) -> str:
    return (f"; but the micro-batch holds 1 sample, and the {what} is finite on that sample "
            f"given twice: {op} reduces over the batch's samples (a batch norm written by "
            "hand, x.var(0), which nn.BatchNorm1d refuses in training for a batch of one; a "
            "minibatch-std layer of a GAN discriminator, a spread of the batch's outputs; a "
            "policy gradient's returns normalised by their std, (R - R.mean()) / (R.std() + "
            "eps), over an episode of one step), whose unbiased form divides by n - 1 = 0 for "
            "one sample, and correction=0 would give 0, no spread: drop the last incomplete "
            "batch (DataLoader(..., drop_last=True)) or skip batches of one sample (an episode "
            "of one step: leave its return unnormalised)")


def _forward_spread(report: dict[str, Any], step: Step) -> None:
    """A forward origin at an unbiased std or var, in a micro-batch of one sample whose model
    output is finite when the batch's tensors hold that sample twice: the same advice."""
    o = report["origin"]
    if report.get("cause") != "invalid" or o.get("op") not in CORRECTED \
            or o.get("batch_size") != 1 or step.model is None:
        return
    mb = o.get("micro_batch") or 0
    prefix = f"batch/{mb}/"
    twin = dataclasses.replace(step, tensors={
        k: _twice(v) if k.startswith(prefix) else v for k, v in step.tensors.items()})
    try:
        run = Runner(twin).run(backward=False, instrument=False)
        outs = run.outputs[mb]
    except Exception:  # (the op's own advice stands)
        return
    if outs and all(bool(torch.isfinite(t).all()) for t in outs if t.is_floating_point()):
        report["hint"] = (report.get("hint") or "") + _spread_text(o["op"], "model's output")
