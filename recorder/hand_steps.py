"""The hooks that end a step of a loop recorded with no optimizer (it updates the weights
itself): the step closes as the backward that took its gradients ends, before the loop's
update writes the weights the forward read. A ``backward()`` is seen by the ``.grad`` hooks
(:meth:`recorder.calls.CallHooks.backward_wrote`); ``torch.autograd.grad`` writes no ``.grad``,
so its gradients are seen as they pass, by a tensor hook on each parameter (one that returns
None: the gradient is unchanged)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .compat import backward_task, func_transform, writes_grads
from .cycle import StepCycle
from .finite import checkable, stored
from .hooks import Health, Hook
from .shards import local
from .slots import GRAD
from .target import Target


def step_end_hooks(target: Target, cycle: StepCycle, health: Health,
                   backward_wrote: Callable) -> list:
    """Register the hooks on ``target``'s trained parameters; returns their handles.
    ``backward_wrote(p)``: queue the step's close at the running backward's end."""
    large = {id(p) for _, p in target.large}  # (their grad_hook calls backward_wrote too)
    handles = [p.register_post_accumulate_grad_hook(Hook(backward_wrote))
               for _, p in target.params if p.requires_grad and id(p) not in large]
    passing = PassingGrads(cycle, health, backward_wrote)
    return handles + [p.register_hook(_PassingHook(passing.passed, i, p))
                      for i, (_, p) in enumerate(target.params) if p.requires_grad]


class PassingGrads:
    """The gradients ``torch.autograd.grad`` hands back (see the module docstring)."""

    __slots__ = ("cycle", "health", "backward_wrote", "task_seen")

    def __init__(self, cycle: StepCycle, health: Health, backward_wrote: Callable):
        self.cycle, self.health, self.backward_wrote = cycle, health, backward_wrote
        self.task_seen = (-2, True)  # (backward id, it writes .grad): asked once per pass

    def passed(self, i: int, p: torch.Tensor, g: torch.Tensor) -> None:
        """Parameter ``i``'s gradient ``g`` on its way. Where the backward writes no ``.grad``,
        its squared norm goes in the step's gradient slot and the step's close is queued. A
        ``backward()`` is left to the ``.grad`` hooks (no norm taken twice); a gradient that
        builds a graph (``create_graph=True``: MAML's inner step, a gradient-norm penalty) is
        the loop's own term, which closes nothing: the step's gradient comes after it."""
        tape = self.cycle.tape
        if tape is None or torch.is_grad_enabled() or not self.health.active:
            return None
        try:
            task = backward_task()
            if task != self.task_seen[0]:
                self.task_seen = (task, writes_grads(p))
            if self.task_seen[1] or not awaits_backward(tape) or not checkable(g):
                return None
            ref = tape.slots.sq_norm(local(stored(g)).detach(), GRAD)
            with tape.lock:
                tape.grad_norms[i] = ref
        except Exception as e:
            self.health.internal_error(e)
            return None
        if not tape.close_queued:
            self.backward_wrote(p)
        return None


def awaits_backward(tape) -> bool:
    """The open step is a training step whose forward returned: a backward now is its own
    (not one inside the forward, an evaluation's, or one under a torch.func transform)."""
    return not tape.evaluation and bool(tape.micro_batches) \
        and tape.micro_batches[-1].outputs is not None and func_transform() is None


class _PassingHook(Hook):
    """A tensor hook on a parameter: torch warns of any such hook when the tensor is pickled
    (sent to a worker process) unless it says it is not to be kept."""

    __slots__ = ()
    __torch_unserializable__ = True
