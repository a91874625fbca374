"""The gradients an update of a multi-rank step read: the bundle's, not the one-process
re-run's.

Under DDP (and ZeRO over it) each rank's update reads the gradient averaged over every rank's
batch. The replay re-runs one rank's batch alone, so its backward leaves that rank's own
gradient: an embedding row only another rank's batch looked up is exactly 0 there, and an
update re-run from it (Adam with ``eps=0``) made NaN in rows that training's update never made
NaN. The bundle records the gradients as the update got them (after the all-reduce); where
they are all there and finite, the re-run of the update reads those.
"""

from __future__ import annotations

import torch

from recorder.finite import finite


def use_reduced_grads(step, model) -> bool:
    """Set each parameter's ``.grad`` to the bundle's gradient when the bundle is one rank's of
    several and holds a finite gradient of every parameter that has one; whether it did."""
    if int((step.meta.get("env") or {}).get("world_size") or 1) < 2:
        return False
    params = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
    recorded = {n: step.tensors.get(f"grads/{n}") for n, _ in params}
    if not params or any(g is None or g.shape != p.shape or not finite(g)
                         for (n, p), g in zip(params, recorded.values())):
        return False
    with torch.no_grad():
        for n, p in params:
            p.grad = recorded[n].to(device=p.device, dtype=p.grad.dtype).clone()
    return True
