"""Buffers the model's own forward writes: state, not constants.

A buffer non-finite when the step began is bad weights when something outside training wrote
it (a checkpoint, an edit), and is intended when it is a ``-inf`` mask, which no forward
writes. One that the forward writes itself (an EMA codebook updated under ``no_grad``,
statistics kept by hand) and that the re-run's forward leaves non-finite again was made so by
that same code in an earlier step: the report goes on to the re-run (whose first op making a
non-finite value is the origin), and a note says which buffer carried it into this step and
which op makes what is written into it. Two forwards more, the first without host reads
(which buffers the forward writes at all), only when a buffer was non-finite.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from recorder.finite import finite, kind_of, matches

from .compat import TorchDispatchMode, tree_leaves, writes_arguments
from .load import Step
from .rerun import Runner
from .source import user_source


class _Writes(TorchDispatchMode):
    """For each watched buffer, the first op of the forward that writes into it a non-finite
    value made in this forward from finite values, and the op that made it: not a value
    carried over from the buffer itself (a BatchNorm running mean that was NaN stays NaN after
    its update)."""

    def __init__(self, buffers: dict[str, torch.Tensor], found: dict[str, dict[str, Any]]):
        super().__init__()
        self.by_storage = {b.untyped_storage().data_ptr(): n for n, b in buffers.items()}
        self.found = found
        # non-finite results of finite values, and what became of them: the op that made them
        self.makers: dict[int, tuple[weakref.ref, tuple[str, str | None]]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        outs = [t for t in tree_leaves(out) if _floating(t)]
        if not outs or all(finite(t) for t in outs):
            return out
        op = f"aten.{func.overloadpacket.__name__}"
        # the values the op computes from: not a destination it overwrites whole
        dest = {id(args[0])} if func.overloadpacket is torch.ops.aten.copy_ else set()
        dest |= {id(t) for t in tree_leaves(kwargs.get("out"))}
        given = [t for t in tree_leaves((args, kwargs)) if _floating(t) and id(t) not in dest]
        maker = next((m for t in given if (m := self._maker(t))), None)
        if maker is None and all(finite(t) for t in given):
            maker = (op, user_source())
        if maker is None:
            return out
        for t in outs:
            self.makers[id(t)] = (weakref.ref(t), maker)
            name = self.by_storage.get(t.untyped_storage().data_ptr())
            if writes_arguments(func) and name is not None and name not in self.found:
                self.found[name] = {"op": op, "source": user_source(), "maker": maker}
        return out

    def _maker(self, t: torch.Tensor) -> tuple[str, str | None] | None:
        ref, maker = self.makers.get(id(t), (None, None))
        return maker if ref is not None and ref() is t else None


class _Touched(TorchDispatchMode):
    """The watched buffers an op of the forward writes into (no host read: a first, cheap
    pass, since a mask buffer is never written)."""

    def __init__(self, buffers: dict[str, torch.Tensor], touched: set[str]):
        super().__init__()
        self.by_storage = {b.untyped_storage().data_ptr(): n for n, b in buffers.items()}
        self.touched = touched

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if writes_arguments(func):
            self.touched.update(n for t in tree_leaves(out) if isinstance(t, torch.Tensor)
                                and (n := self.by_storage.get(t.untyped_storage().data_ptr())))
        return out


def _floating(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and not t.is_meta


def forward_written(step: Step) -> dict[str, dict[str, Any]]:
    """The buffers non-finite when the step began (``allow_inf`` ones aside) into which the
    re-run's forward writes a non-finite value it made from finite ones: ``{name: {"kind",
    "op", "source", "maker"}}`` (``maker``: the op that made the value, and its line)."""
    if step.model is None or step.stripped:
        return {}
    allowed = step.meta.get("allow_inf", [])
    bad = {n: kind_of(t) for k, t in step.tensors.items() if k.startswith("buffers/")
           and not matches(n := k.split("/", 1)[1], allowed) and not finite(t)}
    if not bad:
        return {}
    buffers = dict(step.model.named_buffers())
    watched = {n: buffers[n] for n in bad if n in buffers}
    touched: set[str] = set()
    found: dict[str, dict[str, Any]] = {}
    runner = Runner(step)
    try:
        runner.run(backward=False, instrument=False,
                   forward_ctx=lambda: _Touched(watched, touched))
        watched = {n: b for n, b in watched.items() if n in touched}
        if watched:
            runner.run(backward=False, instrument=False,
                       forward_ctx=lambda: _Writes(watched, found))
    finally:
        runner.reset()  # the buffers as the step began, for the re-runs that follow
    return {n: {"kind": bad[n], **w} for n, w in found.items()}


def state_notes(step: Step, written: dict[str, dict[str, Any]]) -> list[str]:
    k = step.event.get("step")
    # (a bundle with a rewind window has those steps already, though a window's re-run checks
    # module outputs, not buffers: its first non-finite value is still this step's)
    rewind = "" if step.meta.get("rewind") else "; record with rewind=N to re-run the earlier steps"
    return [f"buffer {n} held {w['kind']} when step {k} began, from neither the data nor a "
            f"checkpoint: the model's own forward writes it ({w['op']} at {_at(w['source'])}) "
            f"and in the re-run writes into it again a non-finite value that {w['maker'][0]} "
            f"({_at(w['maker'][1])}) made from finite ones, so that code made it non-finite "
            f"in an earlier step{rewind}"
            for n, w in written.items()]


def _at(source: str | None) -> str:
    return source or "an unknown line"
