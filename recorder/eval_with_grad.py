"""A validation forward run with gradients on (``model.eval()`` with no ``torch.no_grad()``
around the loop). Between steps, a forward with gradients on opens the next training step (the
recorder cannot tell it from a training forward before a backward comes or none does), so the
validation batches become micro-batches of that step and a NaN in one is found as the step
closes, at the training loop's next ``optimizer.step()``, under that step's number (forwards
that no step followed are checked as an evaluation as the recorder detaches:
``StepCycle.close_open_step``). Said at such an event, in the recorder's message and in the
report, so that neither the step nor the micro-batch is read as a training batch's."""

from __future__ import annotations


def ungraded_eval(training: bool, grad_enabled: bool, backward: bool) -> bool:
    """Whether a micro-batch that ran with the root in mode ``training``, gradients
    ``grad_enabled``, and a backward through its output or not (``backward``: a gradient kept,
    or the loop's own ``create_graph`` differentiation of it) is such a forward: eval mode,
    gradients on, no backward."""
    return not training and grad_enabled and not backward


def eval_with_grad_note(micro_batch: int, step: int | None) -> str:
    """What the event in ``micro_batch`` of training step ``step`` is, and what to do."""
    at = f" of step {step}" if step is not None else ""
    return (f"micro-batch {micro_batch}{at} ran with the model in eval mode and gradients on, "
            "and went through no backward: a validation forward run without torch.no_grad() "
            "(model.eval() alone leaves gradients on), which the recorder counts into the next "
            "training step like a training forward, so its event is found when that step "
            "closes (its optimizer.step()) and numbered as that step, "
            "and its batch is the validation batch, not a training batch. Run validation "
            "under torch.no_grad() or torch.inference_mode(): each forward is then checked as "
            "it returns, as an evaluation forward, apart from the training steps")


def bundle_note(meta: dict, micro_batch: int | None) -> str | None:
    """The note for a bundle's event in ``micro_batch`` (its report's origin), from the
    micro-batches' entries (``training``, ``grad_enabled``, ``output_grads``,
    ``differentiated``); None for an evaluation forward's event (checked apart: no training
    step) or another micro-batch."""
    mbs, event = meta.get("micro_batches") or [], meta.get("event") or {}
    if event.get("evaluation") or not isinstance(micro_batch, int) \
            or not 0 <= micro_batch < len(mbs) or not isinstance(mbs[micro_batch], dict):
        return None
    mb = mbs[micro_batch]
    if not ungraded_eval(mb.get("training") is not False, mb.get("grad_enabled") is not False,
                         bool(mb.get("output_grads") or mb.get("differentiated"))):
        return None
    return eval_with_grad_note(micro_batch, event.get("step"))
