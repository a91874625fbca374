"""A batch tensor the model's own forward made require grad, in place.

A Hamiltonian neural network takes its vector field ``(dH/dp, -dH/dq)`` with
``torch.autograd.grad`` by its input, and its ``forward`` often begins with
``x = x.requires_grad_(True)`` on the loader's tensor itself. The bundle, written after that
forward, then holds the batch as an input that required grad in training, which
:mod:`replay.trained_input` reads as a tensor the loop trains (an image optimised as the
model's input, style transfer): a NaN record of the data set was sent to the loop's update
of a tensor it never had. One forward more, on a copy of the micro-batch that does not require
grad, in eval mode (no running statistic moves) tells it: when that copy requires grad after
the forward, the model made it so, and the tensor is data.
"""

from __future__ import annotations

import torch

from .load import Step, micro_batch_inputs
from .train_mode import set_training


def model_made_grad(step: Step, i: int, key: str) -> bool:
    """Does the model's forward of micro-batch ``i`` make its input ``key`` (a bundle key of a
    tensor that required grad) require grad itself? False when it cannot be re-run."""
    model = step.model
    if model is None:
        return False
    made: dict[str, torch.Tensor] = {}
    training = model.training
    try:
        args, kwargs = micro_batch_inputs(step, i, made)
        if key not in made or not made[key].is_leaf:
            return False
        made[key].requires_grad_(False)
        set_training(model, False)
        with torch.enable_grad():
            model(*args, **kwargs)
    except Exception:  # (said as before: only a forward that ran can tell it)
        return False
    finally:
        set_training(model, training)
    return made[key].requires_grad
