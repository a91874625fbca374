"""Lazy modules (``nn.LazyLinear``, ``nn.LazyConv2d``, ...): parameters with no shape until the
first forward infers them from its input. A recorder attached before that forward cannot size,
name or hook them yet, so its attach waits: until a forward of the model begins with every
parameter initialized, the recorder records nothing (the first forward, a dry run or the first
training step, initializes them), then attaches at that forward's start. The optimizer steps
taken meanwhile still count, so the recorder's step numbers stay the loop's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from torch import nn
from torch.nn.parameter import is_lazy

from .hooks import Hook

log = logging.getLogger("nanreplay")


def uninitialized(model: nn.Module, optimizer) -> list[str]:
    """Names of the model's parameters and buffers that have no shape yet (and ``optimizer``
    when it holds such a parameter of another module)."""
    names = [n for n, p in model.named_parameters() if is_lazy(p)]
    names += [n for n, b in model.named_buffers() if is_lazy(b)]
    if not names and optimizer is not None and any(
            is_lazy(p) for g in optimizer.param_groups for p in g["params"]):
        names.append(f"a parameter of {type(optimizer).__name__}")
    return names


class AttachWhenInitialized:
    """Holds a recorder's attach until a forward of ``model`` begins with no lazy parameter
    left; then calls ``attach(steps, inside, module, args, kwargs)`` from that forward's start
    (its pre-hook, the first of the model's to run), with the optimizer steps taken since and
    whether the forward runs inside ``optimizer.step(closure)`` (Lightning's automatic
    optimization, LBFGS): that step began before the recorder's hooks, so it is not
    recorded but counted."""

    def __init__(self, model: nn.Module, optimizer, attach: Callable, names: list[str]):
        self.model_optimizer = (model, optimizer)
        self.attach, self.steps, self.inside = attach, 0, False
        self.handles = [model.register_forward_pre_hook(Hook(self._pre), with_kwargs=True,
                                                        prepend=True)]
        if optimizer is not None:
            self.handles += [optimizer.register_step_pre_hook(Hook(self._stepping)),
                             optimizer.register_step_post_hook(Hook(self._stepped))]
        log.info("nanreplay: %s not initialized yet (lazy modules): recording starts at the "
                 "first forward after one has initialized them", _listed(names))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def _stepping(self, optimizer, args, kwargs) -> None:
        self.inside = True

    def _stepped(self, optimizer, args, kwargs) -> None:
        self.steps, self.inside = self.steps + 1, False

    def _pre(self, module, args, kwargs):
        if uninitialized(*self.model_optimizer):
            return None  # (this forward initializes them, or fails to: the next one is checked)
        self.remove()  # (inside a step: before its post-hooks run, so none is missed)
        return self.attach(self.steps, self.inside, module, args, kwargs)


def _listed(names: list[str]) -> str:
    shown = ", ".join(f"'{n}'" for n in names[:3])
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return f"{shown}{more} {'is' if len(names) == 1 else 'are'}"
