"""Weights no optimizer's update measured: a loop that updates them itself
(``p -= lr * p.grad`` under ``no_grad``, ``torch.autograd.grad`` then a hand-written step),
recorded with ``optimizer=None``.

The ring then holds no weight norm before the event's step, so an absmax jump of every layer
from the first one called looked like the batch's (``replay.precursors.INPUT_JUMP``), and the
report said the data was out of scale when the loop's own update had blown the weights up (a
learning rate of 1e38 at one step). The event step's weights are in the bundle; their norm is
compared with the model as its factory builds it: a thousandfold is no training's growth but
an update that ran away.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["GREW", "OWN_UPDATE_ADVICE", "built_norm", "own_update", "unmeasured",
           "unseen_grads_text", "update_grad_norm", "weight_jump"]

# the least ratio of the event step's weight norm to the factory's that no run's training
# reaches (a weight norm grows ~sqrt(steps) under plain SGD): an update that ran away
GREW = 1e3


# the growth hint's remedy for such a loop: no re-run can repeat its update with another rate
OWN_UPDATE_ADVICE = (
    "lower the learning rate of the loop's own update (p -= lr * p.grad) or clip the "
    "gradients before it; the recorder was given no optimizer, so no what-if (--try) re-runs that "
    "update: write it as a torch.optim optimizer given to FlightRecorder (torch.optim.SGD for "
    "p -= lr * p.grad) to have each update checked, and record with rewind=N so that --try "
    "lr=0.1x re-runs the steps that grew")


def own_update(meta: dict[str, Any]) -> bool:
    """Recorded with no optimizer, outside a Trainer integration (Keras's optimizer steps
    the weights there, not the loop)."""
    return meta.get("optimizer") is None \
        and not (meta.get("recorder") or {}).get("integration")


def update_grad_norm(step) -> float | None:
    """The finite gradient norm of the step before the event, that the loop's own update
    after it used, when the recorder was given no optimizer; else None. Weights non-finite
    as the event's step began then came from that update (cause ``optimizer``, as a
    ``torch.optim.SGD`` doing the same would be), not from weights bad before it."""
    at = step.event.get("step")
    steps, norms = step.tensors.get("ring/steps"), step.tensors.get("ring/grad_norm")
    if not own_update(step.meta) or at is None or steps is None or norms is None:
        return None
    before = [n for s, n in zip(steps.tolist(), norms.tolist()) if s == at - 1]
    return before[0] if before and math.isfinite(before[0]) else None


def unseen_grads_text(step) -> str:
    """Said of weights non-finite as the event's step began when the recorder saw no gradient
    of the step before, which it recorded: the loop took none (a federated server's load) or
    took them with ``torch.autograd.grad`` (which writes no ``.grad``), so a backward's NaN
    reached the update unchecked; "" else."""
    at = step.event.get("step")
    steps, norms = step.tensors.get("ring/steps"), step.tensors.get("ring/grad_norm")
    if not own_update(step.meta) or at is None or steps is None or norms is None:
        return ""
    before = [n for s, n in zip(steps.tolist(), norms.tolist()) if s == at - 1]
    if not before or not math.isnan(before[0]):
        return ""
    return (f". The recorder saw no gradient of step {at - 1} (no backward wrote .grad: the "
            "loop took none, or took them with torch.autograd.grad, which writes none); an "
            "update of such gradients is checked by no one, and a non-finite one (a backward "
            "trap: sqrt or a norm at 0, a division by 0) reaches the weights this way unseen: "
            "while you debug, take them with loss.backward() (the step then ends with the "
            "backward, its gradients checked before the update) and the replay names the op "
            "that made them")


def unmeasured(meta: dict[str, Any], hist: dict[str, Any]) -> bool:
    """No optimizer was given and no weight norm was measured before the event's step."""
    if not own_update(meta):
        return False
    event = hist.get("event_step")
    return not any(w is not None for s, w in zip(hist["steps"], hist.get("weight_norm") or [])
                   if event is None or s < event)


def built_norm(step) -> float | None:
    """The 2-norm (in float64) of the trained parameters of the model the factory builds,
    those the bundle holds; None without a factory, or when it fails."""
    if step.rebuild is None:
        return None
    try:
        with torch.random.fork_rng(devices=[]):  # (the factory draws; the re-runs come after)
            torch.manual_seed(0)  # (one baseline, whatever the replay drew before)
            model = step.rebuild()
    except Exception:  # (a factory needing what the replay lacks: no line, not a failure)
        return None
    frozen = set(step.meta.get("frozen") or ())
    total = sum(float(p.detach().double().square().sum())
                for n, p in model.named_parameters() if n not in frozen
                and p.is_floating_point() and f"weights/{n}" in step.tensors)
    return math.sqrt(total) if total > 0 and math.isfinite(total) else None


def weight_jump(hist: dict[str, Any], built: float | None) -> dict[str, Any] | None:
    """The precursor of weights at the event's step :data:`GREW` times or more the built
    model's (as the loop's update before that step left them), or None."""
    event, norms = hist.get("event_step"), hist.get("weight_norm") or []
    if built is None or event is None or not norms or hist["steps"][-1] != event:
        return None
    now = norms[-1]
    if now is None or now < GREW * built:
        return None
    return {"step": event, "kind": "weight_jump", "ratio": now / built, "layer": None,
            "more": 0, "through": event, "top": now / built,
            "detail": f"weight norm (as the loop's own update before left them) {now:.4g} is "
                      f"{now / built:.3g}x the {built:.4g} of the model as its factory builds "
                      "it (no optimizer was given, so no update before was measured)"}
