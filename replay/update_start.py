"""The state an optimizer's update starts from, kept to re-run that update: the weights, their
gradients (an update may write into ``p.grad``: schedule-free's ``grad.div_(denom)``, Muon's
``grad.lerp_``), the optimizer state, and the param groups' own entries, which an update may
write too (Prodigy's and D-Adaptation's step size ``d``, a step count ``k``): a re-run that
kept the ``d`` the first run left NaN named the first op taking it (a ``mul`` of the sums),
not the division that made it."""

from __future__ import annotations

from typing import Any

import torch

from recorder.capture import map_tensors
from recorder.inner_optim import clear_state, put_state, state_items
from recorder.seq_state import cloned

__all__ = ["saved_start", "restore_start"]


def saved_start(model, opt) -> dict[str, Any]:
    """Copies of what ``opt``'s next update over ``model``'s parameters reads and writes."""
    params = list(model.parameters())
    return {"weights": [p.detach().clone() for p in params],
            "grads": [None if p.grad is None else p.grad.clone() for p in params],
            "state": [(p, map_tensors(dict(st), lambda t: t.clone()))
                      for p, st in state_items(opt)],
            "groups": [{k: cloned(v) for k, v in g.items() if k != "params"}
                       for g in opt.param_groups]}


def restore_start(model, opt, saved: dict[str, Any]) -> None:
    """Put ``saved`` (:func:`saved_start`) back; the copies stay ``saved``'s, so it can be put
    back again."""
    with torch.no_grad():
        for p, w, g in zip(model.parameters(), saved["weights"], saved["grads"]):
            p.copy_(w)
            p.grad = None if g is None else g.clone()
    clear_state(opt)
    for p, st in saved["state"]:
        put_state(opt, p, map_tensors(dict(st), lambda t: t.clone()))
    for group, kept in zip(opt.param_groups, saved["groups"]):
        params, now = group["params"], dict(group)
        group.clear()
        group.update({k: _put(now.get(k), v) for k, v in kept.items()}, params=params)


def _put(now: Any, kept: Any) -> Any:
    """A group's entry as kept: into the tensor it holds now, where it is one of that shape (a
    scheduler's ``fill_`` of a tensor lr writes the group's own tensor), else a copy."""
    if isinstance(now, torch.Tensor) and isinstance(kept, torch.Tensor) \
            and now.shape == kept.shape:
        with torch.no_grad():
            return now.copy_(kept)
    return cloned(kept)
