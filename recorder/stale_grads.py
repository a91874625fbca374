"""Gradients the step's own backward did not write: those of trained parameters the recorded
optimizer does not hold, left from before the step opened by another optimizer's backward.

DreamerV3 steps three optimizers over one module: the world model's (recorded) closes the
step, then the actor's and critic's losses write their gradients, each zeroed just before its
own backward in the next iteration. Under AMP each has its GradScaler, which expects an
overflowed (inf/NaN) gradient now and then and skips its update: that gradient is still there
when the recorded step closes, unused by its update and made by no backward of it. Read as
the step's, it raised a ``backward`` event in a run that trains fine.

Under a GradScaler (the recorder's), the unowned parameters' gradients are left out whoever
wrote them: an overflowed scaled gradient is what the scaler that steps them expects and
skips (their own, or the recorder's, shared as PyTorch's AMP examples share one), as the
recorded optimizer's own are no event when its scaler skips. Recorded on the actor's Adam,
the world model's overflowed backward of the same step raised so.

The keys are taken as a training step opens (``Target.follow_optimizer``: attribute reads of
the few unowned parameters, none in the usual case), and read only on the slow path."""

from __future__ import annotations

import torch

from .compat import version


def grad_keys(params: list[tuple[int, torch.Tensor]]) -> list[tuple[int, int] | None]:
    """Each parameter's gradient as it is now: its identity and version (None: no gradient)."""
    return [None if (g := p.grad) is None else (id(g), version(g)) for _, p in params]


def stale_grads(params: list[tuple[int, torch.Tensor]],
                keys: list[tuple[int, int] | None]) -> set[int]:
    """The indices of ``params`` whose gradient is the one they held as the step opened."""
    if len(keys) != len(params):  # (partitioned again since: nothing is known)
        return set()
    return {i for (i, p), key in zip(params, keys)
            if key is not None and p.grad is not None and key == (id(p.grad), version(p.grad))}


def unused_grads(target) -> set[int]:
    """The parameter indices (``recorder.target.Target``'s) whose non-finite gradients are no
    event of the step: the unowned ones under a GradScaler, else those stale since it opened."""
    if not target.unowned:
        return set()
    if target.has_scaler:
        return {i for i, _ in target.unowned}
    return stale_grads(target.unowned, target.unowned_grads)


def held_first(event, target) -> None:
    """A backward event's parameters with the recorded optimizer's first: the gradients its
    update would use (the critic's, recorded on the critic's Adam) before those another
    optimizer's backward of the same step broke too (the actor's, listed first by position)."""
    unowned = {target.param_names[i] for i, _ in target.unowned}
    params = sorted(event.params, key=lambda n: n in unowned)  # (stable: in model order)
    if not unowned or params == event.params:
        return
    if event.detail:
        event.detail = event.detail.replace(f"first {event.params[0]}", f"first {params[0]}")
    event.params = params
