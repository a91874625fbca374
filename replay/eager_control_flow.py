"""``torch.cond`` and ``torch.while_loop`` run by their Python definitions under the replay's
dispatch modes.

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

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["EagerControlFlow"]


def _cond(pred, true_fn, false_fn, operands):
    return (true_fn if bool(pred) else false_fn)(*operands)


def _while_loop(cond_fn, body_fn, carried_inputs, additional_inputs):
    vals, ran = tuple(carried_inputs), False
    while bool(cond_fn(*vals, *additional_inputs)):
        vals, ran = tuple(body_fn(*vals, *additional_inputs)), True
    # (as torch's own: never the inputs themselves back)
    return vals if ran else tuple(v.clone() if isinstance(v, torch.Tensor) else v
                                  for v in vals)


def _definitions() -> dict:
    found = {}
    for name, fn in (("cond", _cond), ("while_loop", _while_loop)):
        op = getattr(torch.ops.higher_order, name, None)  # (a torch without it: left alone)
        if op is not None:
            found[op] = fn
    return found


_DEFINED = _definitions()


class EagerControlFlow(TorchFunctionMode):
    """Sees each higher-order op before autograd does (which would keep the raw callables for
    the backward): cond and while_loop called with no keyword (the eager entry's form) run by
    their definitions; every other call passes on unchanged."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        run = _DEFINED.get(func) if not kwargs else None
        if run is None:
            return func(*args, **(kwargs or {}))
        with self:  # (a cond inside a branch is met again)
            return run(*args)
