"""The gradient backward brings to each root output, kept by the micro-batch (the replay feeds
it back into the re-run output; its norm is checked when the step closes: recorder.grads)."""

from __future__ import annotations

import torch


# The step's backward runs with grad mode off. A backward that builds a graph is the loop's
# own differentiation of the output (a PINN's loss taking autograd.grad(u, x, ones,
# create_graph=True), MAML's inner step): the gradient it brings is not the one the step's
# backward sent into the output, which the replay feeds in its place, so it is not kept; that
# it ran is (``marks``), for the replay to say the loop's own term is not re-run.
def keep_grad(store: dict, marks: list, i: int, grad: torch.Tensor) -> None:
    if not torch.is_grad_enabled():
        _add(store, i, grad)
    elif not marks:
        marks.append(True)


def keep_out_grad(store: dict, marks: list, i: int, nr: int, grad_outputs: tuple) -> None:
    grad = grad_outputs[nr]
    if grad is not None and not torch.is_grad_enabled():
        _add(store, i, grad)
    elif grad is not None and not marks:
        marks.append(True)


def _add(store: dict, i: int, grad: torch.Tensor) -> None:
    """Summed over the step's backward passes through the output, as the parameters' gradients
    are: one per task (``loss_a.backward(retain_graph=True); loss_b.backward()``, or gradient
    surgery's ``autograd.grad`` per task), the last alone would hide an earlier task's NaN."""
    before = store.get(i)
    try:
        store[i] = grad if before is None else before + grad
    except RuntimeError:  # (another shape or layout: the pass of another loss)
        store[i] = grad
