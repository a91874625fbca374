"""The loop's own gradient clipping in a window re-run (``replay.window``): the recorder saw
a ``clip_grad_norm_`` between backward and ``optimizer.step()`` only as the smaller gradient
norm each recorded update used, so the re-run applies it again from that norm.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from recorder.capture import tensor_leaves
from recorder.finite import stored


def loop_clip(step, win, record: dict[str, Any], change, norm: float | None,
              loss: float | None = None, factors=()) -> float | None:
    """The loop's own ``clip_grad_norm_`` between backward and ``optimizer.step()``, which
    the recorder saw only as the smaller gradient norm the update used (the ring's). Left
    out, a window whose every update was clipped ran away where training did not. The
    unchanged re-run scales the gradients to the recorded norm, as the clip did, and keeps
    the norm it clipped to (the loop's max_norm); a what-if, whose gradients differ, clips to
    that max_norm, or to the try's own ``clip``. A larger norm where the re-run's ``loss``
    is not the recorded one is no clipping: the re-run has left training's path (an optimizer
    wrapper's state the bundle lacks, Lookahead's slow weights or its inner Adam's moments),
    and scaling its gradients to the recorded norm would hide that and clip every what-if.
    A norm larger by the very factor the loop put on the loss (``factors``, this step's:
    ``(loss * scale).backward()``) is the loop's own unscaling (``p.grad.div_(scale)``, a loss
    scaler written by hand): the gradients are divided by it, as the loop did, and so are a
    what-if's, by the factor it puts on its loss. A recorded norm of 0 where the re-run's
    overflows its dtype (the loop's clip zeroed such gradients, its max_norm unseen) makes a
    what-if zero its own gradients whose norm overflows (``win.loop_zeroes``). Returns the
    norm the update then used, for an unscaling (the window's statistics show that one, as
    the ring does), else None."""
    params = [p for p in step.model.parameters() if p.grad is not None]
    grads = [p.grad for p in params]
    if change.clip is not None:
        clip_grads(params, change.clip)
    elif change == type(change)():
        rec = _recorded_grad_norm(step, record["step"])
        if rec is None or norm is None or not norm > rec * (1 + 1e-3) \
                or not _same_loss(step, record["step"], loss):
            return None
        # (0 where the norm in the gradients' own dtype overflowed: clip_grad_norm_'s
        # coefficient max_norm / inf, whatever max_norm, or the loop's own skip of such a step)
        win.loop_zeroes = win.loop_zeroes or rec == 0 and not norm_finite(grads)
        for g in grads:
            g.mul_(rec / norm)
        if (k := _one(factors)) is not None and k > 1 + 1e-3 and abs(norm / rec / k - 1) < 1e-3:
            win.loop_unscale = True
            return rec
        if rec > 0:  # (0: clip_grad_norm_ of an infinite norm zeroed the gradients)
            win.loop_clip = max(win.loop_clip or 0.0, rec)
    elif win.loop_clip is not None:
        clip_grads(params, win.loop_clip)
    elif win.loop_zeroes and not norm_finite(grads):  # (a what-if's: as the loop zeroed them)
        for g in grads:
            g.zero_()
    if change.clip is None and change != type(change)() and win.loop_unscale \
            and (k := _one(win.loss_factors or ())) is not None:
        for g in grads:
            g.div_(k)
    return None


def _one(factors) -> float | None:
    """The factor every micro-batch's loss was multiplied by, if one and finite."""
    ks = [float(k) for k in factors]
    return ks[0] if ks and math.isfinite(ks[0]) and all(
        abs(k - ks[0]) <= 1e-6 * abs(ks[0]) for k in ks) else None


def total_norm(tensors) -> float | None:
    """The 2-norm of ``tensors`` together; a sparse gradient's (``nn.Embedding(sparse=True)``)
    by its stored values, uncoalesced, as the recorder measures it without a sync (an id used
    twice counts twice): the re-run's norm is compared with the ring's, and a norm of another
    measure read as the loop's clipping. A tensor on the meta device (a placeholder parameter:
    a hypernetwork's main network built there) holds no value and counts for nothing."""
    norms = [stored(t.detach()).abs().double().norm() for t in tensors
             if t is not None and t.numel() and not t.is_meta]
    return float(torch.stack(norms).norm()) if norms else None


def ring_loss(run) -> float | None:
    """The re-run's loss as the recorder's ring measures it (``recorder.ring``): the mean,
    over the step's loss calls, of each floating output's largest value. A loss_fn that
    returns its total beside the terms it logs (CompressAI's ``{"bpp_loss", "mse_loss",
    "loss"}``) is recorded as the mean of the three, which the total never equals: compared
    with that total, every clipped update read as a re-run that had left training's path."""
    vals = [float(t.detach().max()) for loss in run.losses for t in tensor_leaves(loss)
            if t.is_floating_point() and t.numel()]
    return sum(vals) / len(vals) if vals else None


def norm_finite(grads) -> bool:
    """Whether the gradients' total norm, taken as ``clip_grad_norm_`` takes it (in their own
    dtype: float32 overflows above ~1.8e19 per tensor's norm squared), is finite."""
    grads = [stored(g.detach()) for g in grads if g.numel() and not g.is_meta]
    return not grads or bool(torch.isfinite(torch.nn.utils.get_total_norm(grads)))


def clip_grads(params: list[torch.Tensor], max_norm: float) -> None:
    """``clip_grad_norm_`` of the gradients of ``params``; with a sparse one among them, which
    torch's refuses, scaled by the norm :func:`total_norm` measures."""
    grads = [p.grad for p in params]
    if all(g.layout == torch.strided for g in grads):
        torch.nn.utils.clip_grad_norm_(params, max_norm)
        return
    norm = total_norm(grads)
    coef = 1.0 if norm is None else min(1.0, max_norm / (norm + 1e-6))
    for g in grads:
        g.mul_(coef)


def _same_loss(step, k: int, loss: float | None) -> bool:
    """The re-run's loss of step ``k`` (:func:`ring_loss`) is the recorded one (the ring's),
    as a clip, which comes after the loss, leaves it; True when either is unknown."""
    rec = _recorded(step, k, "ring/loss")
    return rec is None or loss is None or not math.isfinite(loss) \
        or abs(loss - rec) <= 1e-5 * max(abs(rec), 1e-6)


def _recorded_grad_norm(step, k: int) -> float | None:
    """The total gradient norm the recorded update of step ``k`` used (the ring's), if
    finite."""
    return _recorded(step, k, "ring/grad_norm")


def _recorded(step, k: int, key: str) -> float | None:
    """Step ``k``'s finite value of the ring's ``key``, else None."""
    steps, norms = step.tensors.get("ring/steps"), step.tensors.get(key)
    if steps is None or norms is None:
        return None
    hit = (steps == k).nonzero()
    if not len(hit):
        return None
    v = float(norms[int(hit[0, 0])])
    return v if math.isfinite(v) else None
