"""Buffers whose infinities a division by 0 made while the model was built: no masks.

:func:`replay.storages.mask_buffers` reads a buffer holding +-inf as a mask, its infinity
intended. A mask's infinity is written as a literal (``torch.full(.., -inf)``,
``masked_fill(m, -inf)``) or a log of 0s (``tril(ones).log()``); a table where a division
of finite values made one (ALiBi's
slopes ``1 / torch.arange(H)``, whose head 0 is ``1 / 0``) holds an accident, and the NaN it
makes later (``slope * (kv_idx - q_idx)``: ``inf * 0`` on the diagonal) was reported as a
mask's, with a mask's advice. The factory is run again under :class:`PoleMade`, which follows
the storages such an op's infinity went into (``buffer.copy_(1 / arange)``), so those buffers
are left out of the masks.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from recorder.finite import finite

from .compat import TorchDispatchMode, tree_leaves
from .source import user_source
from .storages import mask_buffers, storage_of

# (log(tril(ones)) writes a mask's -inf by a pole too, on purpose: only a division's is read
# as an accident)
_DIVISIONS = {"div", "div_", "reciprocal", "reciprocal_", "true_divide", "true_divide_"}


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor) and not t.is_meta
            and (t.is_floating_point() or t.is_complex())]


class PoleMade(TorchDispatchMode):
    """Around a factory call: ``storages``, where an infinity a division of finite values
    made lives (its outputs, and those of ops passing one on: a copy, an index, a cat)."""

    def __init__(self):
        super().__init__()
        self.storages: dict[int, str | None] = {}  # (the division's user source line)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ins = _tensors((args, kwargs))
        bad_in = [t for t in ins if t.numel() and not finite(t)]
        # (a literal +-inf among the arguments writes a mask: never a pole's)
        literal = any(isinstance(x, float) and abs(x) == float("inf")
                      for x in tree_leaves((args, kwargs)))
        out = func(*args, **kwargs)
        if literal:
            return out
        # (a division of finite values, or an op given only a division's infinities: a
        # copy_ into the buffer returns it)
        if bad_in and all(storage_of(t) in self.storages for t in bad_in):
            src = self.storages[storage_of(bad_in[0])]
        elif not bad_in and func.overloadpacket.__name__ in _DIVISIONS:
            src = user_source()
        else:
            return out
        self.storages |= {s: src for t in _tensors(out) if t.numel() and not finite(t)
                          and (s := storage_of(t)) is not None}
        return out


def pole_buffers(step) -> dict[str, str | None]:
    """Names of the factory's buffers holding an infinity a division of finite values made
    when it built the model (empty where the bundle's factory cannot be run again)."""
    if getattr(step, "rebuild", None) is None:
        return {}
    made = PoleMade()
    try:
        with made:
            model = step.rebuild()
        buffers = list(model.named_buffers())
    except Exception:  # (the factory ran once already; this only narrows the masks)
        return {}
    return {name: made.storages[s] for name, b in buffers
            if (s := storage_of(b)) in made.storages}


def step_masks(step, model: torch.nn.Module) -> dict[int, str]:
    """:func:`replay.storages.mask_buffers` of ``model`` less the step's :func:`pole_buffers`
    (found once per step, and only where some buffer holds an infinity)."""
    masks = mask_buffers(model)
    if masks and step.pole_buffers is None:
        step.pole_buffers = pole_buffers(step)
    return {k: n for k, n in masks.items() if n not in (step.pole_buffers or ())}


def pole_buffer_hint(report: dict[str, Any], step) -> None:
    """Name the origin module's buffers that :func:`pole_buffers` found, where a NaN was made
    of infinities (the report's op took one of theirs: inf * 0, inf - inf)."""
    module, o = report["origin"].get("module"), report["origin"]
    if not step.pole_buffers or report.get("cause") != "invalid" or module is None \
            or not any(isinstance(v, float) and math.isinf(v) for v in o.get("input_range") or ()):
        return  # (an op given no infinity made it: not of a table's)
    own = [(n, src) for n, src in step.pole_buffers.items()
           if not module or n.startswith(module + ".") and "." not in n[len(module) + 1:]]
    if not own:
        return
    name, src = own[0]
    at = f" at {src}" if src else ""
    report["hint"] = (
        f"{report['hint']}. Buffer {name} holds an infinity a division of finite values made "
        f"when the factory built the model{at} (a table such as per-head slopes "
        "1 / torch.arange(n), whose entry 0 is 1 / 0): no mask, as no infinity was written "
        "there on purpose; keep that divisor away from 0 (start the range at 1, or clamp it)")
