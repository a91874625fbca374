"""A backward overflow at the end of a gradient that grew through a rollout's steps.

A differentiable simulation unrolled in one forward (a policy trained through a few hundred
semi-implicit Euler steps, a chaotic or stiff system) runs the same line's backward node once
per step; where the dynamics stretch, the gradient entering it grows step after step
(Metz et al. 2021, "Gradients are not all you need") while the states stay bounded, until
one product overflows. The node that overflowed is only where it ended and float64 only
postpones it; what helps is on the rollout: a shorter or truncated backward, contracting
dynamics, a bound on each step's gradient. Clipping after ``backward()`` cannot, the overflow
is inside it.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch

from recorder.capture import tensor_leaves
from recorder.finite import finite
from recorder.scripted import hookable_modules

from .compat import sequence_nr
from .domains import g
from .rerun import Runner
from .source import node_source, node_tracebacks

MIN_NODES = 8  # earlier runs of the node at that line: fewer is no rollout
GROWTH = 100.0  # the last incoming gradient's largest magnitude over the first's
STEADY = 0.5  # the least share of its runs whose gradient is no smaller than the one before


def explain(report: dict[str, Any], runner: Runner, node: str | None, source: str | None,
            summed: int = 0) -> None:
    """Rewrite the ``overflow`` hint of backward node ``node`` (made at ``source``; ``summed``:
    the engine's sum of its incoming gradients overflowed, see :mod:`replay.summed_grads`)
    when its earlier runs at that line grew so (see the module), and say the growth in
    ``problems``."""
    if report.get("cause") != "overflow" or not node or not source:
        return
    sizes = _incoming_sizes(runner, node, source)
    grew = _growing(sizes)
    if grew is None:
        return
    first, last = g(grew[0]), g(grew[1])
    what = f"the sum of the gradients into {node}" if summed else node
    report["hint"] = (
        f"{what} overflowed after {len(sizes) - 1} earlier runs of the same node ({source}), "
        f"one per step of a loop the forward unrolled, its incoming gradient growing from "
        f"{first} where the backward entered the loop to {last}: backpropagation through "
        "the rollout is exploding (unstable or chaotic dynamics, a long horizon), which "
        "float64 only postpones; shorten the horizon or truncate the backward (detach the "
        "state every k steps), make the dynamics contract (a smaller dt, damping, a stable "
        "integrator), or bound each step's gradient inside the rollout (a hook on the "
        "state); clipping the gradient after backward() cannot help: the overflow is inside it")
    report["problems"].append(
        f"the gradient entering {node} at {source} grew from {first} to {last} over "
        f"{len(sizes)} backward steps of the rollout: exploding gradients through time")


def _growing(sizes: list[float]) -> tuple[float, float] | None:
    """(first, last) of the incoming gradients' sizes, oldest first, when they grew steadily."""
    while sizes and sizes[0] == 0:  # (steps the loss does not reach yet)
        sizes = sizes[1:]
    if len(sizes) <= MIN_NODES or not all(math.isfinite(v) for v in sizes):
        return None
    first, last = sizes[0], sizes[-1]
    rises = sum(b >= a for a, b in zip(sizes, sizes[1:])) / (len(sizes) - 1)
    if last < GROWTH * first or last < max(sizes) or rises < STEADY:
        return None
    return first, last


def _incoming_sizes(runner: Runner, node: str, source: str) -> list[float]:
    """The largest magnitude of the gradient entering each run of node ``node`` made at
    ``source`` in a re-run's backward, in the order they ran, through the first that made a
    non-finite gradient; empty unless one module made them all (a rollout in one forward, a
    cell called step after step; not the same line in each block of a stack)."""
    sizes: list[tuple[str, float]] = []
    ended: list[bool] = []
    seen: set = set()
    calls: list[int] = []  # per open module call: its inputs' newest node number

    def hook(name, grad_inputs, grad_outputs):
        incoming = [x for x in grad_outputs if isinstance(x, torch.Tensor) and x.numel()]
        if ended or not incoming or not all(finite(x) for x in incoming):
            return
        sizes.append((name, max(float(x.detach().abs().max()) for x in incoming)))
        ended.extend(True for x in grad_inputs if isinstance(x, torch.Tensor) and not finite(x))

    def enter(module, args, kwargs):
        calls.append(max((sequence_nr(f) for f in _grad_fns((args, kwargs))), default=-1))

    def leave(name, module, args, output):  # (the nodes the call made: newer than its inputs)
        before, todo = calls.pop() if calls else -1, _grad_fns(output)
        while todo:
            fn = todo.pop()
            if fn is None or fn in seen or sequence_nr(fn) <= before:
                continue
            seen.add(fn)
            if fn.name() == node and node_source(fn) == source:
                fn.register_hook(partial(hook, name))
            todo.extend(f for f, _ in fn.next_functions)

    def hooks(model) -> list:
        return [h for name, m in hookable_modules(model)
                for h in (m.register_forward_pre_hook(enter, with_kwargs=True),
                          m.register_forward_hook(partial(leave, name)))]

    try:
        runner.run(instrument=False, forward_ctx=node_tracebacks, hooks=hooks)
    except Exception:  # (a re-run that fails here only loses the growth, not the report)
        return []
    return [v for _, v in sizes] if len({name for name, _ in sizes}) == 1 else []


def _grad_fns(tree) -> list:
    return [t.grad_fn for t in tensor_leaves(tree)
            if isinstance(t, torch.Tensor) and t.grad_fn is not None]
