"""Module calls the backward pass makes: a custom ``autograd.Function`` whose ``backward``
calls a module of the model (the adjoint method's reverse solve of a neural ODE, which runs
the ODE function again to rebuild the state and its vector-Jacobian products). The recorder's
hooks count those calls after the forward's, as forward calls; a forward-only re-run never
reaches them, so the op finder re-runs the backward too for such a call, and the report says
where it ran."""

from __future__ import annotations

import weakref
from typing import Any

import torch

# finders whose call was reached only by re-running the backward pass
_IN_BACKWARD: weakref.WeakSet = weakref.WeakSet()


def run_to_call(runner: Any, finder: Any, state: dict, call: int, hooks, forward_ctx) -> None:
    """Re-run until module call ``call`` has run (``state["count"]`` passed it), the forward
    alone first, then with the backward pass when the forward never reached it."""
    for backward in (False, True):
        try:
            runner.run(backward=backward, instrument=False, hooks=hooks,
                       forward_ctx=forward_ctx)
        finally:
            if state["active"]:
                state["active"] = False
                finder.__exit__(None, None, None)
        if state["count"] > call:
            if backward:
                _IN_BACKWARD.add(finder)
            return
        state["count"] = 0


def backward_call_note(report: dict, finder: Any, module: str, call: int) -> None:
    """Say in the report's problems that the origin's call ran in the backward pass."""
    if finder in _IN_BACKWARD:
        report["problems"].append(
            f"{module or '<root>'} call {call} ran in the backward pass, after the forward's "
            "calls: code the backward runs called it (a custom autograd.Function's backward, "
            "as the adjoint method's reverse solve does); the recorder counts it as a forward "
            "call, and no bisection was run: its probes re-run the forward only")


def user_backward(node: Any) -> bool:
    """``node`` is a custom ``autograd.Function``'s backward: the op ran in code the user
    wrote (its line names it), not in a derivative torch derived from a forward op, whose
    pole the forward's input would have to avoid."""
    return isinstance(node, torch.autograd.function.BackwardCFunction)
