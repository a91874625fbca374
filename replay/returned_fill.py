"""The literal +-inf fill whose values a module call returned.

When the only non-finite value of a call is an intended infinity that reaches its output (a
summarizer restricting generation to the article's words: ``logits.masked_fill(~allowed,
-inf)``), the op finder keeps the call's first literal fill, which may be another, consumed
inside the call: ``nn.Transformer.generate_square_subsequent_mask``'s ``full(-inf)``, which
attention turned into finite weights. The report then named the causal mask's line for an
infinity it never returned. :func:`returned_fill` re-runs the forward once and names the fill
whose output the call returned (the last such, by storage).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .compat import TorchDispatchMode, tree_leaves
from .rerun import Runner
from .source import user_source

__all__ = ["returned_fill"]


class _Fills(TorchDispatchMode):
    """Records, while ``state["active"]``, each op given a literal +-inf: (name, literal,
    line, storage of its output, its occurrence among the call's ops of that name, the
    module call running it)."""

    def __init__(self, state: dict, where: _Where):
        super().__init__()
        self.state, self.fills, self.counts, self.where = state, [], {}, where

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.state["active"]:
            return out
        name = func.overloadpacket.__name__
        occurrence = self.counts.get(name, 0)
        self.counts[name] = occurrence + 1
        literal = next((a for a in tree_leaves((args, kwargs))
                        if isinstance(a, float) and math.isinf(a)), None)
        if literal is not None and isinstance(out, torch.Tensor) and out.is_floating_point():
            self.fills.append((name, literal, user_source(), _storage(out), occurrence,
                               self.where.now()))
        return out


class _Where:
    """The innermost call running inside call ``o`` (its submodules' calls numbered per
    micro-batch, as the instrumented pass numbers them; ``o`` itself between them): the fill
    is blamed on the call whose code made it, the caller's own ``forward`` after its children
    returned (a policy masking its padded vocabulary's logits) included."""

    def __init__(self, runner: Runner, o):
        self.runner, self.o = runner, o
        self.seen: dict[str, int] = {}
        self.stack: list[tuple[str, int]] = []

    def now(self) -> tuple[str, int]:
        return self.stack[-1] if self.stack else (self.o.module, self.o.call)

    def hooks(self, target) -> list:
        def enter(name):
            def pre(m, args):
                if self.runner.micro_batch == self.o.micro_batch:
                    k = self.seen.get(name, 0)
                    self.seen[name] = k + 1
                    self.stack.append((name, k))
            return pre

        def leave(m, args, out):
            if self.runner.micro_batch == self.o.micro_batch and self.stack:
                self.stack.pop()

        return [h for name, m in target.named_modules(prefix=self.o.module) if m is not target
                for h in (m.register_forward_pre_hook(enter(name)),
                          m.register_forward_hook(leave))]


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def returned_fill(runner: Runner, o, finder):
    """``finder.intentional``, or the fill whose output module call ``o`` returned when that
    is another op (a later ``masked_fill`` than the causal mask's ``full``)."""
    first = finder.intentional
    module = dict(runner.model.named_modules()).get(o.module)
    if first is None or module is None:
        return first
    state = {"active": False, "calls": 0, "out": None}

    def pre(m, args):
        if runner.micro_batch == o.micro_batch:
            state["calls"] += 1
            state["active"] = state["calls"] == o.call + 1

    def post(m, args, out):
        if state["active"]:
            state["active"], state["out"] = False, out

    where = _Where(runner, o)
    fills = _Fills(state, where)
    try:
        runner.run(backward=False, instrument=False, forward_ctx=lambda: fills,
                   hooks=lambda model: [module.register_forward_pre_hook(pre),
                                        module.register_forward_hook(post)]
                   + where.hooks(module))
    except Exception:  # (a model the extra re-run cannot take: the first fill, as before)
        return first
    returned = {_storage(t): t for t in tree_leaves(state["out"])
                if isinstance(t, torch.Tensor) and t.is_floating_point()
                and not bool(torch.isfinite(t).all())}
    name, literal, source, storage, occurrence, within = next(
        (f for f in reversed(fills.fills) if f[3] in returned), (None,) * 6)
    if name is None or (f"aten.{name}", source, within) == (first.op, first.source,
                                                           first.within):
        return first
    try:
        rows = finder.batch_rows([returned[storage]])
    except Exception:  # (the rows help; the op is named without them)
        rows = first.rows
    return dataclasses.replace(first, op=f"aten.{name}", made="-inf" if literal < 0 else "+inf",
                               source=source, occurrence=occurrence, buffer=None, rows=rows,
                               within=within)
