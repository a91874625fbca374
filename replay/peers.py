"""The other ranks of a data-parallel step in a window re-run (``replay.window``): DDP and
FSDP2 updated the weights with the gradients averaged over the ranks, so each rank's recorded
micro-batches are re-run on the one rebuilt model and their gradients averaged before the
update.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from .rerun import Runner


def peer_gradients(step, peers, record: dict[str, Any], change, scale: float | None,
                   sub_step) -> dict[str, torch.Tensor] | None:
    """The sum of the other ranks' gradients of ``record``'s step (their forward and
    backward re-run on the shared model, before this rank's, which runs last and leaves its
    buffers and RNG as a run of this rank alone does); None without peers. A what-if's
    ``drop`` removes rows of this rank's batch only. ``sub_step(step, window, record, change)``
    is the window's view of one recorded step (``replay.window``)."""
    if not peers:
        return None
    total: dict[str, torch.Tensor] = {}
    theirs = dataclasses.replace(change, drop=None)
    for peer, pwin in peers:
        rec = next(x for x in pwin.records if x["step"] == record["step"])
        runner = Runner(sub_step(peer, pwin, rec, theirs))
        runner.cast = change.dtype
        if scale is not None and math.isfinite(scale):
            runner.loss_scale = scale
        runner.run(instrument=False)
        for n, p in step.model.named_parameters():
            if p.grad is not None:
                total[n] = total[n] + p.grad if n in total else p.grad.detach().clone()
    step.model.zero_grad(set_to_none=True)
    return total


def average_gradients(model, others: dict[str, torch.Tensor], world: int) -> None:
    """This rank's gradients plus the others', divided by the world size (DDP's mean)."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in others:
                p.grad = others[n] if p.grad is None else p.grad + others[n]
            if p.grad is not None:
                p.grad = p.grad / world
