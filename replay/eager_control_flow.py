"""``torch.cond`` and ``torch.while_loop`` by their Python definitions, which the replay runs
them by (:func:`replay.compat.eager_torch`).

In training, dynamo traces each branch or loop body into a graph taking and returning flat
tuples of tensors, the form the operators' own autograd and schema code expect. Under a
watching mode dynamo skips the frame (and the modes force eager), so the operator gets the
user's callables as written: a bound method (``self.pos.forward``) or a branch returning one
tensor, which torch's ``make_fx`` of the branch refuses ('Tracing expected 2 arguments') and
cond's backward cannot read ('object of type bool has no len()'). Run as their documented
definitions (``true_fn(*operands) if pred else false_fn(*operands)``; the loop calling
``body_fn`` while ``cond_fn`` holds), their ops are the model's own aten ops, with their own
autograd nodes: the op finders, anomaly mode and the float64 re-run see the op inside the
branch, as for any other line of the model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["definitions"]


def _cond(pred, true_fn, false_fn, operands):
    return (true_fn if bool(pred) else false_fn)(*operands)


def _while_loop(cond_fn, body_fn, carried_inputs, additional_inputs):
    vals, ran = tuple(carried_inputs), False
    while bool(cond_fn(*vals, *additional_inputs)):
        vals, ran = tuple(body_fn(*vals, *additional_inputs)), True
    # (as torch's own: never the inputs themselves back)
    return vals if ran else tuple(v.clone() if isinstance(v, torch.Tensor) else v
                                  for v in vals)


def definitions() -> dict[object, Callable]:
    """Each operator (``torch.ops.higher_order.cond``, ``.while_loop``) this torch has, with
    the function defining it, called as the operator is (positional, no keyword)."""
    found = {}
    for name, fn in (("cond", _cond), ("while_loop", _while_loop)):
        op = getattr(torch.ops.higher_order, name, None)  # (a torch without it: left alone)
        if op is not None:
            found[op] = fn
    return found
