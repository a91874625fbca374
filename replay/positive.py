"""Values positive in exact arithmetic for every finite argument, so that a 0 they hold is a
positive value that underflowed (``underflow``, not ``invalid``).

exp, softmax, sigmoid and softplus make them; ops that pass values on unchanged keep them
(a gathered probability, a view), and so do a power of one (``std ** 2``: a Gaussian's
variance from ``log_std.exp()``), a product of them with positive factors (``2 * var``), and
a sum of them: a reduction, or a matrix product with a tensor whose values are all > 0
(Sinkhorn's ``K @ v`` with ``K = exp(-C / eps)``, whose row of zeros is an underflow).
Followed both as the op finder sees ops run and, for a value made before the watched code
ran (a model's softplus variance that the loss takes the log of), on the autograd graph.
"""

from __future__ import annotations

import torch

from .compat import saved_value

# Ops whose result is positive in exact arithmetic for every finite argument: a 0 they return
# is an underflow. Ops that pass values on unchanged keep that mark (a gathered probability).
POSITIVE = {"exp", "exp2", "_softmax", "softmax", "sigmoid", "special_expit", "softplus"}
PASS_ON = {"gather", "index_select", "select", "slice", "view", "_unsafe_view", "reshape",
           "squeeze", "unsqueeze", "clone", "_to_copy", "expand", "permute", "transpose", "t",
           "contiguous", "alias", "narrow", "take_along_dim", "index", "unbind", "split",
           "split_with_sizes", "detach", "masked_select", "flatten", "unflatten", "diagonal",
           "as_strided", "div",  # div: a positive value over a finite one stays non-zero
           "pow"}  # a positive base to any power stays positive
# sums of products of their inputs' elements: positive when every term is (a row sum of
# exp, K @ v of a positive kernel and positive scalings)
SUMS = {"add", "mm", "bmm", "mv", "dot", "vdot"}
REDUCTIONS = {"sum", "mean", "cumsum"}  # (their numbers are dims)


def node_name(op: str) -> str:
    """A backward node's name (``Backward<n>`` dropped) for aten op ``op``: ``IndexSelect`` for
    ``index_select``, ``UnsafeView`` for ``_unsafe_view``."""
    return "".join(part.capitalize() for part in op.split("_"))


# The same rule on the autograd graph, for a value made before the watched code ran (a
# model's softplus variance that the loss takes the log of); a reshape's node is ReshapeAlias
_POSITIVE_NODES = {node_name(op) for op in POSITIVE}
_PASS_ON_NODES = {node_name(op) for op in PASS_ON} | {"ReshapeAlias"}


def node_op(node) -> str:
    name = node.name()
    return name[: name.rfind("Backward")] if "Backward" in name else name


def positive_result(name: str, ins: list[torch.Tensor], leaves: list, positive) -> bool:
    """Whether op ``name``, given finite inputs ``ins`` (``leaves``: all its arguments), made
    a value positive in exact arithmetic; ``positive(t)`` says it of an input."""
    if name in POSITIVE or (name in PASS_ON | REDUCTIONS and ins and positive(ins[0])):
        return True
    numbers = [v for v in leaves if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if name in SUMS and ins and any(positive(t) for t in ins):
        # every term positive: the other factors' values all > 0 (v = ones, b / (K^T u));
        # the inputs are finite here, so ``> 0`` reads their values (add's alpha too)
        return all(v > 0 for v in numbers) and all(
            positive(t) or bool((t > 0).all()) for t in ins)
    # a product of positive tensors and positive numbers (2 * var)
    return name == "mul" and bool(ins) and all(positive(t) for t in ins) and all(
        v > 0 for v in numbers)


def first_inputs(fn, depth: int = 8):
    """(op, node) of autograd node ``fn`` and the nodes of its first input after it, at most
    ``depth``: the path a value took from the op that made it, through views and selections."""
    for _ in range(depth):
        if fn is None:
            return
        yield node_op(fn), fn
        fn = next((f for f, _ in fn.next_functions if f is not None), None)


def made_positive(fn, depth: int = 8) -> bool:
    """Whether autograd node ``fn`` made its value by exp, softmax, sigmoid or softplus
    (directly, or viewed, gathered, sliced, divided, raised to a power, multiplied by positive
    factors). ``depth`` bounds the walk."""
    try:
        for op, node in first_inputs(fn, depth):
            if op in _POSITIVE_NODES:
                return True
            if op == "Mul":
                return _positive_product(node, depth - 1)
            if op not in _PASS_ON_NODES:
                return False
    except Exception:  # not an autograd node, or one that cannot say
        return False
    return False


def _positive_product(fn, depth: int) -> bool:
    """A ``MulBackward0`` whose factors are each made positive, or a constant > 0 (a factor
    without a gradient: the node saved it for the other's)."""
    nexts = [f for f, _ in fn.next_functions]
    saved = [saved_value(fn, "self"), saved_value(fn, "other")]
    for i, f in enumerate(nexts[:2]):
        if f is not None:
            if not made_positive(f, depth):
                return False
            continue
        const = saved[i]  # (factor i's value, saved for the other factor's gradient)
        if not isinstance(const, torch.Tensor) or not bool((const > 0).all()):
            return False
    return True


def exp_of_parameter(fn, depth: int = 10):
    """The leaf tensor (a parameter) whose exp made the value of autograd node ``fn``, through
    the ops :func:`made_positive` follows (``exp(log_std) ** 2``, expanded, times 2), or None:
    a learned log-scale that drifted until its exp underflowed (a Gaussian policy's
    ``log_std``)."""
    try:
        for _ in range(depth):
            if fn is None:
                return None
            op = node_op(fn)
            if op == "Exp":
                return _leaf(next((f for f, _ in fn.next_functions if f is not None), None))
            if op not in _PASS_ON_NODES and op != "Mul":
                return None
            fn = next((f for f, _ in fn.next_functions if f is not None), None)
    except Exception:  # not an autograd node, or one that cannot say
        return None
    return None


def _leaf(fn, depth: int = 6):
    """The tensor an ``AccumulateGrad`` node accumulates into, reached through views."""
    for _ in range(depth):
        if fn is None:
            return None
        if type(fn).__name__ == "AccumulateGrad" or fn.name().endswith("AccumulateGrad"):
            return getattr(fn, "variable", None)
        if node_op(fn) not in _PASS_ON_NODES:
            return None
        fn = next((f for f, _ in fn.next_functions if f is not None), None)
    return None
