"""Whether a loss argument that has an autograd graph was computed from the recorded model.

A loss argument with a ``grad_fn`` is usually the model's output or made from it
(``out.log_softmax(-1)``): its NaN is the model's or the loss code's, not data. But another
network's output has a graph too: deep mutual learning's peer (``crit(a, b, y)`` with
``b = net2(x)``), a teacher the loop forgot to run under ``no_grad``. Such an argument is a
target the loop computed, as a teacher's detached logits are. Only read at an event (the slow
path): a walk of the argument's graph, which stops at the model output's nodes and the model's
parameters.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

_LIMIT = 20000  # nodes walked before giving up (then: from the model, as before)


def from_model(t: torch.Tensor, outputs: Iterable[torch.Tensor],
               params: Iterable[torch.Tensor] | None) -> bool:
    """``t``'s graph reaches the model: a node of one of its ``outputs`` or the gradient
    accumulator of one of its ``params``. True when unsure (no params known, a huge graph)."""
    fn = t.grad_fn
    if fn is None:
        return False
    if params is None:
        return True
    stops = {o.grad_fn for o in outputs if isinstance(o, torch.Tensor) and o.grad_fn is not None}
    owned = {id(p) for p in params}
    seen, todo = set(), [fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        if node in stops or id(getattr(node, "variable", None)) in owned:
            return True
        seen.add(node)
        if len(seen) > _LIMIT:
            return True
        todo.extend(nxt for nxt, _ in node.next_functions)
    return False
