"""A loss's division by 0 whose 0 a layer of the model's weights, all 0, made.

A field whose last layer is zero-initialised (a head started at 0 with a constant bias) is
constant: its gradient ``autograd.grad(f, x)`` is 0 at every point, and a loss normalising it
into normals (``grad / grad.norm()``) is 0/0 in every sample at the first step. The loss
re-run names the division and an eps, which would keep every normal 0; the cause is the
model's weight. Told apart as :mod:`replay.zero_state` tells a module's: one forward and loss
more with that weight filled with random values, whose loss is finite.
"""

from __future__ import annotations

import torch

from .recorded import samples
from .rerun import Runner
from .zero_state import ZERO_LAYER, run_with_random, some_rows

_DIVIDES = {"aten.div", "aten.reciprocal", "aten.rsqrt"}


def zero_head_hint(runner: Runner, mb: int, hit, cause: str, hint: str | None) -> str | None:
    """The hint naming a trained weight matrix of the model, all 0 as the step began, without
    which the loss of micro-batch ``mb`` is finite, when the division is at its pole in every
    sample; else ``hint``."""
    if cause != "invalid" or hit is None or hit.op not in _DIVIDES or runner.model is None \
            or not hit.rows or some_rows(hit.rows, samples(runner.step, mb)):
        return hint  # (at the pole in some samples only: their own values, not a layer of 0)
    runner.reset()  # (the weights as the step began)
    zero = [(n, p) for n, p in runner.model.named_parameters() if p.requires_grad
            and p.is_floating_point() and p.dim() > 1 and not p.any()]
    for name, p in zero:  # (a matrix: a zero bias alone does not make a layer's output 0)
        if _finite_without(runner, mb, p):
            return ZERO_LAYER.format(op=hit.op, what=f"parameter {name}")
    return hint


def _finite_without(runner: Runner, mb: int, p: torch.Tensor) -> bool:
    """Is micro-batch ``mb``'s loss finite with ``p`` filled with random values?"""
    run = run_with_random(runner, p, backward=False)
    return mb in run.loss_micro_batches and run.loss_finite[run.loss_micro_batches.index(mb)]
