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
from types import SimpleNamespace

import torch

from .compat import TorchDispatchMode, tree_leaves
from .literal_fill import literals
from .rerun import Runner
from .source import user_source

__all__ = ["returned_fill"]


class _Fills(TorchDispatchMode):
    """Records, while ``state["active"]``, each op given a literal +-inf: (name, literal,
    line, storage of its output, its occurrence among the call's ops of that name)."""

    def __init__(self, state: dict, where):
        super().__init__()
        self.state, self.fills, self.counts, self.where = state, [], {}, where

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.state["active"]:
            return out
        name = func.overloadpacket.__name__
        occurrence = self.counts.get(name, 0)
        self.counts[name] = occurrence + 1
        literal = literals(name, tree_leaves((args, kwargs)), [])[0]  # (x[m] = -inf's too)
        if literal is not None and isinstance(out, torch.Tensor) and out.is_floating_point():
            self.fills.append((name, literal, user_source(), _storage(out), occurrence,
                               self.where.where))
        return out


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def returned_fill(runner: Runner, o, finder, track):
    """``finder.intentional``, or the fill whose output module call ``o`` returned when that
    is another op (a later ``masked_fill`` than the causal mask's ``full``), with the
    innermost call that ran it (``track(where, module)``: hooks keeping ``where.where`` on
    it; the first fill's, a Transformer's key padding, was named for one in ``o``'s own
    code)."""
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

    where = SimpleNamespace(where=(o.module, o.call), entered={}, counts={})
    fills = _Fills(state, where)
    try:
        runner.run(backward=False, instrument=False, forward_ctx=lambda: fills,
                   hooks=lambda model: [module.register_forward_pre_hook(pre),
                                        module.register_forward_hook(post),
                                        *track(where, module)])
    except Exception:  # (a model the extra re-run cannot take: the first fill, as before)
        return first
    returned = {_storage(t): t for t in tree_leaves(state["out"])
                if isinstance(t, torch.Tensor) and t.is_floating_point()
                and not bool(torch.isfinite(t).all())}
    name, literal, source, storage, occurrence, within = next(
        (f for f in reversed(fills.fills) if f[3] in returned), (None,) * 6)
    if name is None or (f"aten.{name}", source) == (first.op, first.source):
        return first
    try:
        rows = finder.batch_rows([returned[storage]])
    except Exception:  # (the rows help; the op is named without them)
        rows = first.rows
    return dataclasses.replace(first, op=f"aten.{name}", made="-inf" if literal < 0 else "+inf",
                               source=source, occurrence=occurrence, buffer=None, rows=rows,
                               within=within)
