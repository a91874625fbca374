"""A loss that holds a network of parameters (a GAN generator's loss around the discriminator,
a learned perceptual network) whose weights were non-finite when the loss ran. The loss's
buffers and tensors (class weights, an EWC Fisher) are made once, before training; its
parameters are what an optimizer updates, and the recorded one does not hold them: the other
network's own update in the step (a discriminator's step on a NaN loss, its zero-initialised
layer under spectral_norm making 0/0) is where to look, which this replay cannot re-run. Where the GradScaler skipped the step before, that other
optimizer stepped outside the scaler and applied the overflowed gradients it skipped."""

from __future__ import annotations

import torch
from torch import nn

from .loss_params import trained_loss_params
from .precursors import history

NETWORK = ("{op} took {held}: the loss holds a network whose parameters are non-finite ({n} "
           "of {total}, first {first}), which the recorded optimizer does not update: an "
           "optimizer the recorder was not given (a GAN's discriminator stepped beside the "
           "recorded generator), or the network's own forward and backward before it, made "
           "them so, earlier than this loss, and the replay cannot re-run that update. Record "
           "that network with its optimizer (FlightRecorder({sub}, its optimizer, ...)) to "
           "name the op, or check its update: a layer initialised to 0 under weight_norm or "
           "spectral_norm (0/0), its learning rate, its gradient clipping")

# the step before was one the GradScaler skipped: a second optimizer stepped directly, not
# through the scaler, applies the scaled gradients that overflowed as they are
SCALER_BYPASSED = (
    "{op} took {held}: the loss holds parameters that are non-finite ({n} of {total}, first "
    "{first}), which the recorded optimizer does not update, and the GradScaler skipped step "
    "{skipped}, the one before, because its scaled gradients overflowed: an optimizer stepped "
    "directly instead of through the scaler (loss_optimizer.step() beside "
    "scaler.step(optimizer): the optimizer of a metric loss's proxies or class weights, a "
    "GAN's discriminator) applied those non-finite gradients, which the scaler skips only for "
    "the optimizers it steps. Step every optimizer through the scaler "
    "(scaler.step(loss_optimizer) before scaler.update()), or unscale its gradients and skip "
    "its step when they are not finite{half}")
# ... and those parameters are float16 themselves (pytorch-metric-learning's losses cast their
# weights to the embeddings' type, float16 under autocast), which GradScaler refuses to unscale
HALF_PARAMS = (
    "; but {first} is {dtype} (the loss cast it to its inputs' type under autocast), and the "
    "scaler refuses to unscale {dtype} gradients ('Attempting to unscale FP16 gradients'): "
    "call the loss outside autocast on float32 inputs (loss_func(embeddings.float(), labels)) "
    "so its parameters stay float32, then step them through the scaler")


def _half(step, name: str) -> str:
    """:data:`HALF_PARAMS` when the loss's parameter ``name`` is in a half type, else ""."""
    p = dict(step.loss_fn.named_parameters()).get(name)
    if p is None or p.dtype not in (torch.float16, torch.bfloat16):
        return ""
    return HALF_PARAMS.format(first=name, dtype=str(p.dtype).removeprefix("torch."))


def network_params(step) -> tuple[list[str], int]:
    """The names of the loss module's parameters that hold NaN/±Inf, and how many it has,
    leaving out those the recorded optimizer trains (a learned temperature: ``<loss>.NAME``,
    whose update the replay does re-run)."""
    loss_fn = getattr(step, "loss_fn", None)
    if not isinstance(loss_fn, nn.Module):
        return [], 0
    own = {id(p) for p in trained_loss_params(step)}
    params = [(n, p) for n, p in loss_fn.named_parameters()
              if p.is_floating_point() and id(p) not in own]
    return [n for n, p in params if not bool(torch.isfinite(p.detach()).all())], len(params)


def network_hint(step, op: str, held: str) -> str | None:
    """The hint of a loss op that took a non-finite tensor of a loss holding non-finite
    parameters other optimizers train (None when all of those are finite)."""
    bad, total = network_params(step)
    if not bad:
        return None
    if (skipped := skipped_before(step)) is not None:
        return SCALER_BYPASSED.format(op=op, held=held, n=len(bad), total=total, first=bad[0],
                                      skipped=skipped, half=_half(step, bad[0]))
    sub = bad[0].split(".")[0] if "." in bad[0] else "the network"
    return NETWORK.format(op=op, held=held, n=len(bad), total=total, first=bad[0], sub=sub)


def skipped_before(step) -> int | None:
    """The step before the event's, when the recorded GradScaler skipped it (the ring's
    ``skipped``), else None."""
    meta, tensors = getattr(step, "meta", None), getattr(step, "tensors", None)
    if not isinstance(meta, dict) or not isinstance(tensors, dict):
        return None
    hist = history(meta, tensors)
    event = hist.get("event_step")
    before = [(s, k) for s, k in zip(hist["steps"], hist.get("skipped") or [])
              if event is not None and s < event]
    return before[-1][0] if before and before[-1][1] and before[-1][0] == event - 1 else None
