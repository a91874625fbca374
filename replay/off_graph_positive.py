"""Values positive in exact arithmetic that the forward made off the autograd graph, where
:func:`replay.backward.from_positive` cannot follow them: a divisor computed from a tensor no
gradient reaches (a temperature ``log_tau.exp()`` an evolution strategy tunes, given to
``forward``). A quotient's backward at such a divisor's 0 is an underflow, not rounding onto
the pole, as it is for the same value made on the graph.
"""

from __future__ import annotations

import torch

from recorder.finite import finite

from .pole_hints import zero_divisor_off_graph
from .positive import (
    OF_POSITIVE_VALUES,
    PASS_ON,
    POSITIVE,
    REDUCTIONS,
    SELECTS,
    SUMS,
    positive_result,
)

# Python-level names of the ops replay.positive's aten rule knows
_ALIASES = {"__getitem__": "select", "__truediv__": "div", "__mul__": "mul", "__rmul__": "mul",
            "__add__": "add", "__radd__": "add", "__pow__": "pow", "div_": "div"}

_KNOWN = POSITIVE | PASS_ON | REDUCTIONS | SUMS | SELECTS | OF_POSITIVE_VALUES | {"mul"}


def _key(t: torch.Tensor):
    try:
        return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())
    except Exception:  # (no storage: a sparse, nested or wrapped tensor, never marked)
        return None


class OffGraphPositive:
    """The off-graph tensors exp/softmax/sigmoid/softplus made of finite arguments, and
    views, sums and positive multiples of them (by storage and layout), as a torch function
    mode (:class:`replay.below_one.BelowOneNodes`) calls :meth:`seen` with each op."""

    def __init__(self) -> None:
        self.keys: set = set()
        self.kept: list[torch.Tensor] = []  # (strong references: no storage reused meanwhile)

    def seen(self, func, args, kwargs, out) -> None:
        try:
            self._see(func, args, kwargs, out)
        except Exception:  # (never the user's run: a vmap's batched tensor refuses the
            pass  # finiteness read, ``functorch.jacrev`` of a contractive penalty)

    def _see(self, func, args, kwargs, out) -> None:
        if not isinstance(out, torch.Tensor) or out.grad_fn is not None \
                or not out.is_floating_point() or out.requires_grad:
            return
        name = getattr(func, "__name__", "")
        name = _ALIASES.get(name, name)
        if name not in _KNOWN:
            return
        leaves = list(args) + list((kwargs or {}).values())
        ins = [t for t in leaves if isinstance(t, torch.Tensor)]
        if ins and all(t.is_floating_point() and finite(t) for t in ins) and positive_result(
                name, ins, leaves, self.positive) and (key := _key(out)) is not None:
            self.keys.add(key)
            self.kept.append(out)

    def positive(self, t: torch.Tensor) -> bool:
        return isinstance(t, torch.Tensor) and (key := _key(t)) is not None and key in self.keys

    def divisor(self, node) -> bool:
        """Quotient node ``node``'s divisor is off the graph, holds a 0, and is such a value."""
        other = zero_divisor_off_graph(node)
        return other is not None and self.positive(other)
