"""Hooks that keep the names of the module calls running now (innermost last), for a dispatch
mode that names the module an op ran in (:mod:`replay.diverging_op`, :mod:`replay.kept_outside`).
Calls made inside a torch.func transform are not counted, as the op finder does not count them."""

from __future__ import annotations

from collections.abc import Callable

from recorder.scripted import hookable_modules

from .transforms import outside_transforms


def call_stack_hooks(model, stack: list[str], entered: Callable | None = None) -> list:
    """Pre- and forward hooks on ``model``'s hookable modules pushing and popping their names
    on ``stack``; ``entered(args, kwargs)``, when given, sees each call's inputs first.
    Returns the handles."""
    def enter(name: str):
        def pre(m, args, kwargs) -> None:
            if entered is not None:
                entered(args, kwargs)
            stack.append(name)
        return pre

    def leave(m, args, out) -> None:
        if stack:
            stack.pop()

    hs = []
    for name, m in hookable_modules(model):
        hs.append(m.register_forward_pre_hook(outside_transforms(enter(name)), with_kwargs=True))
        hs.append(m.register_forward_hook(outside_transforms(leave)))
    return hs
