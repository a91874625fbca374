"""The loop's own gradient clipping in a window re-run (``replay.window``): the recorder saw
a ``clip_grad_norm_`` between backward and ``optimizer.step()`` only as the smaller gradient
norm each recorded update used, so the re-run applies it again from that norm.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def loop_clip(step, win, record: dict[str, Any], change, norm: float | None) -> None:
    """The loop's own ``clip_grad_norm_`` between backward and ``optimizer.step()``, which
    the recorder saw only as the smaller gradient norm the update used (the ring's). Left
    out, a window whose every update was clipped ran away where training did not. The
    unchanged re-run scales the gradients to the recorded norm, as the clip did, and keeps
    the norm it clipped to (the loop's max_norm); a what-if, whose gradients differ, clips to
    that max_norm, or to the try's own ``clip``."""
    grads = [p.grad for p in step.model.parameters() if p.grad is not None]
    if change.clip is not None:
        torch.nn.utils.clip_grad_norm_(step.model.parameters(), change.clip)
    elif change == type(change)():
        rec = _recorded_grad_norm(step, record["step"])
        if rec is None or norm is None or not norm > rec * (1 + 1e-3):
            return
        for g in grads:
            g.mul_(rec / norm)
        if rec > 0:  # (0: clip_grad_norm_ of an infinite norm zeroed the gradients)
            win.loop_clip = max(win.loop_clip or 0.0, rec)
    elif win.loop_clip is not None:
        torch.nn.utils.clip_grad_norm_(step.model.parameters(), win.loop_clip)


def _recorded_grad_norm(step, k: int) -> float | None:
    """The total gradient norm the recorded update of step ``k`` used (the ring's), if
    finite."""
    steps, norms = step.tensors.get("ring/steps"), step.tensors.get("ring/grad_norm")
    if steps is None or norms is None:
        return None
    hit = (steps == k).nonzero()
    if not len(hit):
        return None
    v = float(norms[int(hit[0, 0])])
    return v if math.isfinite(v) else None
