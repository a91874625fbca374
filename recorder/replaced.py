"""Parameters the loop replaced after attach under the same name: Gaussian splatting's
densification and pruning (3DGS's ``cat_tensors_to_optimizer``, gsplat's strategies) put a
grown or shrunk ``nn.Parameter`` into the module and into the optimizer's group between
steps. The recorder follows them by name, so that its checks and the bundle hold the tensors
that train, not the dropped ones (whose stale values would not reproduce the event)."""

from __future__ import annotations

import torch
from torch import nn

from .compiled import eager_name
from .events import Event
from .finite import kind_of


def group_heads(opt) -> list[torch.Tensor | None]:
    """The first parameter of each of ``opt``'s groups: what a swap replaces (one parameter
    per group in 3DGS and gsplat), compared by identity at each step's open."""
    return [g["params"][0] if g["params"] else None for g in opt.param_groups]


def heads_moved(opt, heads: list) -> bool:
    """Whether a group's first parameter is no longer the one recorded (O(groups))."""
    for g, h in zip(opt.param_groups, heads):
        ps = g["params"]
        if (ps[0] if ps else None) is not h:
            return True
    return False


def swapped(model: nn.Module, params: list[tuple[str, torch.Tensor]]
            ) -> dict[int, tuple[str, torch.Tensor]]:
    """Index -> (name, the model's tensor now) for each recorded parameter the model holds
    no longer, another tensor now under its name. (A parameter renamed rather than replaced
    is :meth:`recorder.target.Target.rename`'s.)"""
    now = {eager_name(n): p for n, p in model.named_parameters() if not p.is_meta}
    held = {id(p) for p in now.values()}
    return {i: (n, now[n]) for i, (n, p) in enumerate(params)
            if id(p) not in held and n in now}


def bad_kinds(moved: dict[int, tuple[str, torch.Tensor]]) -> dict[str, str]:
    """Name -> kind of the swapped-in parameters already non-finite (one read per swap, which
    is rare: a densification every few hundred steps): the loop wrote them, not an update."""
    return {n: k for n, p in moved.values() if (k := kind_of(p.detach())) is not None}


def swapped_in_event(step: int, bad: list[str], kinds: dict[str, str]) -> Event | None:
    """The weights event for non-finite parameters ``bad`` an update seemed to make, when
    every one was non-finite as the loop swapped it in (a relocation's ``logit(1)``): the
    loop's write, before ``optimizer.step()`` ran. None otherwise."""
    if not bad or not all(n in kinds for n in bad):
        return None
    return Event(step, phase="weights", params=bad, kind=kinds[bad[0]], first_seen_step=step,
                 detail=f"non-finite values already in {len(bad)} parameter(s), first "
                        f"{bad[0]}, first seen at step {step}: the training loop put them in as "
                        "new parameters (replaced in the module and the optimizer since attach) "
                        "holding them, before optimizer.step() ran")
