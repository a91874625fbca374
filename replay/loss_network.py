"""A loss that holds a network of parameters (a GAN generator's loss around the discriminator,
a learned perceptual network) whose weights were non-finite when the loss ran. The loss's
buffers and tensors (class weights, an EWC Fisher) are made once, before training; its
parameters are what an optimizer updates, and the recorded one does not hold them: the other
network's own update in the step (a discriminator's step on a NaN loss, its zero-initialised
layer under spectral_norm making 0/0) is where to look, which this replay cannot re-run."""

from __future__ import annotations

import torch
from torch import nn

from .loss_params import trained_loss_params

NETWORK = ("{op} took {held}: the loss holds a network whose parameters are non-finite ({n} "
           "of {total}, first {first}), which the recorded optimizer does not update: an "
           "optimizer the recorder was not given (a GAN's discriminator stepped beside the "
           "recorded generator), or the network's own forward and backward before it, made "
           "them so, earlier than this loss, and the replay cannot re-run that update. Record "
           "that network with its optimizer (FlightRecorder({sub}, its optimizer, ...)) to "
           "name the op, or check its update: a layer initialised to 0 under weight_norm or "
           "spectral_norm (0/0), its learning rate, its gradient clipping")


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
    sub = bad[0].split(".")[0] if "." in bad[0] else "the network"
    return NETWORK.format(op=op, held=held, n=len(bad), total=total, first=bad[0], sub=sub)
