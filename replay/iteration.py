"""Which run of its source line the blamed op was, in the module call that made it.

A recurrence written as a loop over time steps (an sLSTM's or mLSTM's ``for t in range(T)``,
a WKV kernel's running max) runs the op's line once a step: the line alone does not say
whether the first NaN came at the first step (a bad initial state) or after a hundred (a
state growing until it overflowed, the first padded position). One more forward-only re-run
counts the op's calls made at that line in the call, up to the blamed one. An op of a
library module (``nn.Linear`` under autocast: a cast of its bias, input and weight) has its
caller's line as its source, which one module call runs once, whatever the op's calls there.
"""

from __future__ import annotations

from typing import Any

import torch

from .compat import TorchDispatchMode
from .dispatch import run_op
from .errors import StopRun
from .load import autocast_as_recorded
from .source import user_source
from .transforms import outside_transforms

# a line's runs are counted only while the op's calls before the blamed one are this few
# (a stack walk each: a call of a large model's thousands of matmuls is no loop to name)
MOST = 5000


class _LineRuns(TorchDispatchMode):
    """Counts the calls of ``op`` made at ``source`` among its first ``occurrence + 1``."""

    def __init__(self, op: str, occurrence: int, source: str):
        super().__init__()
        self.name, self.occurrence, self.source = op.removeprefix("aten."), occurrence, source
        self.seen = self.runs = 0
        self.sizes: list[Any] = []  # each earlier run's largest magnitude, on the device
        self.took: list[frozenset[int]] = []  # the parameters each run's ops took since the last
        self._since: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = run_op(func, args, kwargs or {})
        self._since.update(id(a) for a in args if isinstance(a, torch.nn.Parameter))
        if func.overloadpacket.__name__ == self.name and self.seen <= self.occurrence:
            self.seen += 1
            here = user_source() == self.source
            self.runs += here
            if here:
                self.took.append(frozenset(self._since))
                self._since = set()
            if here and self.seen <= self.occurrence and isinstance(out, torch.Tensor) \
                    and out.is_floating_point() and out.numel():
                self.sizes.append(out.detach().abs().amax().float())
        return out


def line_run(runner, module: str, call: int, mb: int, hit: Any
             ) -> tuple[int | None, list[float], bool]:
    """The 1-based run of ``hit``'s op at ``hit.source`` in call ``call`` of ``module``
    (``hit.occurrence`` counted from that call's start); None when it cannot be told. With it,
    the largest magnitude of the op's output at each earlier run of the line (a loop in the
    module's own code growing run after run: :mod:`replay.recurrence`); and whether each run
    took parameters of its own (:func:`layer_stack`: then no sizes)."""
    if hit is None or not hit.source or hit.occurrence > MOST or hit.node is not None:
        return None, [], False
    counter = _LineRuns(hit.op, hit.occurrence, hit.source)
    state = {"count": 0, "active": False}

    def hooks(model):
        target = model.get_submodule(module) if module else model

        def pre(m, args):
            if runner.micro_batch == mb:
                if state["count"] == call:
                    state["active"] = True
                    state["caller"] = user_source()  # (the line that called the module)
                    counter.__enter__()
                state["count"] += 1

        def post(m, args, out):
            if state["active"]:
                state["active"] = False
                counter.__exit__(None, None, None)
                raise StopRun

        return [target.register_forward_pre_hook(outside_transforms(pre)),
                target.register_forward_hook(outside_transforms(post))]

    try:
        runner.run(backward=False, instrument=False, hooks=hooks)
    except Exception:  # (no count then; the origin stands as found)
        return None, [], False
    finally:
        if state["active"]:
            counter.__exit__(None, None, None)
    if counter.seen != hit.occurrence + 1 or not counter.runs:
        return None, [], False
    if state.get("caller") == hit.source:  # (a library module's casts and matmul at its
        return 1, [], False  # caller's line: one run of that line, however many op calls)
    if layer_stack(counter.took):  # (growth through depth, not iterates: no diverging loop)
        return counter.runs, [], True
    sizes = torch.stack(counter.sizes).tolist() if counter.sizes else []  # (one host read)
    return counter.runs, sizes, False


def loss_line_run(step, mb: int, hit: Any, args, kwargs) -> int | None:
    """The 1-based run of a loss origin's op at its line among the loss's ops, re-run on the
    same arguments (a multi-scale loss's loop: MiDaS's gradient matching at every ``2**k``-th
    pixel, whose coarsest scale alone has no valid pixel); None when it cannot be told."""
    if hit is None or not hit.source or hit.occurrence > MOST or hit.node is not None:
        return None
    counter = _LineRuns(hit.op, hit.occurrence, hit.source)
    try:
        with torch.no_grad(), autocast_as_recorded(step.micro_batches[mb], step.device,
                                                   loss=True), counter:
            step.loss_fn(*args, **kwargs)
    except Exception:  # (no count then; the origin stands as found)
        return None
    return counter.runs if counter.seen == hit.occurrence + 1 and counter.runs else None


def layer_stack(took: list[frozenset[int]]) -> bool:
    """Each run of the line followed ops on parameters of its own (IBP's interval bounds
    through ``for layer in self.layers``, each layer's ``|W| r``): its values grew through
    the depth of a stack of layers, which a wider type holds, not by iterating one map (an
    unrolled recurrence, a fixed-point loop: the same weights, or none, every run)."""
    return len(took) > 1 and all(took) and len(set(took)) == len(took)
