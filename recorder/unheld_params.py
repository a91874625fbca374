"""Parameters the optimizer holds that the model no longer uses, said once as the first
training step closes.

The recorder is built with an optimizer over the model's parameters (checked then). A resume
that loads a checkpoint with ``model.load_state_dict(state, assign=True)`` (as a meta-device
build must) puts new ``Parameter`` objects in the model; so does assigning a new layer or
``nn.Parameter`` to it. An optimizer built before keeps the old ones: ``optimizer.step()``
updates tensors no forward reads, the model never trains, and no value goes non-finite to
say so. The first training step's close compares the two (one set of ids, once).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from .validate import stray_params

log = logging.getLogger("nanreplay")


def say_unheld(model: nn.Module | None, optimizer: torch.optim.Optimizer | None,
               loss_fn: nn.Module | None = None) -> None:
    """Log, once per call, the optimizer's parameters that ``model`` (or the loss module,
    whose learnable parameters the optimizer may hold) no longer holds."""
    if model is None or optimizer is None:
        return
    gone = stray_params(model, optimizer, loss_fn)
    if not gone:
        return
    held = [p for g in optimizer.param_groups for p in g["params"]]
    which = "none of them is" if len(gone) == len(held) else f"{len(gone)} of {len(held)} are not"
    log.warning("nanreplay: the optimizer holds %d parameter tensor(s), and %s among the "
                "model's now: the model's were replaced after the optimizer was built "
                "(model.load_state_dict(..., assign=True) makes new ones, as does assigning a "
                "new layer or nn.Parameter), so optimizer.step() updates tensors the forward "
                "no longer reads and those weights never train; build the optimizer after "
                "loading (or load without assign=True), then the recorder", len(held), which)
