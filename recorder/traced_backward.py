"""A ``loss.backward()`` that dynamo traced after the recorder's hooks split the compiled
training step: no parameter got a gradient, said once as the first training step closes.

With ``torch._dynamo.config.trace_autograd_ops = True`` (the setting dynamo's own graph-break
hint for ``Tensor.backward()`` names), a compiled function holding the forward, the loss and
``loss.backward()`` traces the backward as ``autograd.grad`` over the leaves that its graph
read. The recorder's hooks around the model run outside dynamo's graphs, so they split that
function after the model's call; the graph resumed there never read the parameters, and the
backward it traces writes no gradient to any of them (torch 2.13): ``optimizer.step()``
updates nothing, silently, where the same function without the recorder trains. Nothing goes
non-finite to say so, so the first training step's close says it.
"""

from __future__ import annotations

import logging

import torch

from .compat import traces_backward

log = logging.getLogger("nanreplay")


def say_backward_wrote_nothing(optimizer: torch.optim.Optimizer) -> bool:
    """Log, and return True, when dynamo traces backward and none of ``optimizer``'s
    parameters holds a gradient as the first training step's update is about to run."""
    if not traces_backward():
        return False
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if not params or any(p.grad is not None for p in params):
        return False
    log.warning("nanreplay: the first training step's optimizer.step() found no gradient on "
                "any parameter while torch._dynamo.config.trace_autograd_ops is True: where "
                "the model's call and loss.backward() run in one torch.compile'd function, the "
                "recorder's hooks around the model split its graph there, and the backward "
                "dynamo traces after the split writes no gradient to parameters that graph "
                "never read, so nothing trains; call loss.backward() (and optimizer.step()) "
                "outside the compiled function and compile the model itself "
                "(torch.compile(model)), or leave trace_autograd_ops off")
    return True
