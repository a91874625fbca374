"""An ``optimizer`` event of a recording that never recorded a step: no micro-batch and no
row of history. The loop's forward never ran through the recorded model's ``__call__``
(``model.forward(x)`` called directly, as mnist_forward_forward's ``Layer.train`` calls
``self.forward(x_pos)``, only the model's parts called, or the model called only under
torch.func transforms, which the recorder leaves alone), so no step opened, nothing was
checked, and only the last update's evidence, read as the recorder detached, saw the
weights non-finite. The gradients the bundle holds are the last backward's, made through
those weights: they say nothing of the update that first broke them, which is unknown."""

from __future__ import annotations

from typing import Any

from .findings import finish, origin_fields
from .load import Step

UNRECORDED = (
    "no step of the model was recorded (no micro-batch, no history): its forward never ran "
    "through the recorded model's __call__ outside torch.func transforms, so nothing was "
    "checked before this, the last update's check as the recorder detached; call the model "
    "itself, model(x), not model.forward(x) (which runs no hooks), or give FlightRecorder the "
    "module the loop calls; a loop that calls it only under transforms (torch.func.jvp, vmap, "
    "grad: a MeanFlow or consistency loss's jvp, per-sample gradients), which are not "
    "recorded, calls it once outside them with gradients on in each step (the forward of "
    "the loss you log); then the first non-finite loss, gradient or update is caught at its "
    "step")

# a container the loop never calls itself: a helper runs its children one by one
# (torch.utils.checkpoint.checkpoint_sequential(model, segments, x) calls model[i], never model)
_CONTAINERS = {"torch.nn.modules.container.Sequential": "nn.Sequential",
               "torch.nn.modules.container.ModuleList": "nn.ModuleList"}
CHILDREN_RUN = (
    "the recorded model is an {kind}, whose children the loop runs itself "
    "(checkpoint_sequential(model, segments, x) calls each child, never the {kind}), so no "
    "hook of the model ran and nothing was checked before this, the last update's check as "
    "the recorder detached; record a module holding it as self.body whose forward runs them "
    "(return checkpoint_sequential(self.body, segments, x, use_reentrant=False)), with its "
    "factory; then the first non-finite loss, gradient or "
    "update is caught at its step")


def advice(step: Step) -> str:
    """What to change in the loop: for a container root, how to record the helper's run."""
    kind = _CONTAINERS.get((step.meta.get("model") or {}).get("class") or "")
    return CHILDREN_RUN.format(kind=kind) if kind else UNRECORDED


def unrecorded(step: Step) -> bool:
    """The bundle holds no micro-batch and no row of history, and its event is an update that
    closed no recorded step (``no_step_closed``; before it was marked, the step before the
    first): no step ever opened (a loop that runs no forward at all, Reptile's meta-update,
    counts a step at each ``optimizer.step()``). With a micro-batch (an evaluation forward
    found the weights broken: SB3's rollout after its SAC actor's update) the update's own
    hint is ``replay.unrecorded_update``'s."""
    ring, at = step.meta.get("ring") or {}, step.event.get("step")
    closed_none = step.event.get("no_step_closed") or (isinstance(at, int) and at < 0)
    return not step.micro_batches and not ring.get("stored") and bool(closed_none)


def report_unrecorded(report: dict[str, Any], step: Step, params: list[str]
                      ) -> dict[str, Any] | None:
    """The report of an update's event in a recording with no step (see the module's
    docstring): not reproduced, with what to change in the loop; None when a step was
    recorded."""
    if not unrecorded(step):
        return None
    kinds = [k for k in ("nan", "inf") if any(
        (g := step.tensors.get(f"grads/{n}")) is not None and bool(
            (g.isnan() if k == "nan" else g.isinf()).any()) for n in params)]
    grads = (f" (the bundle's gradients of {params[0]} hold {' and '.join(kinds)}: those of the "
             "last backward, through the broken weights)" if kinds else "")
    origin = origin_fields(phase="optimizer", params=params, param=(params or [None])[0])
    return finish(report, origin, "not_reproduced", reproduced=False,
                  hint=f"the weights {', '.join(params)} were non-finite after an update at "
                  f"an unknown step{grads}; {advice(step)}")
