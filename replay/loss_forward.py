"""A micro-batch whose forward ran inside its own loss call: WGAN-GP's critic loss, given the
critic, draws the interpolation weights (``torch.rand``) and then calls the critic on the
interpolates for the gradient penalty. The recorder files that loss under the critic's
third micro-batch (the call on the interpolates) and captures that micro-batch's RNG as its
forward began, after the loss had drawn ``alpha``. The re-run runs the forward from that
state, then the loss, which draws ``alpha`` and the critic's dropout masks again from the
state the forward left: other interpolates and masks than training's, a penalty at other
packs. The loss is re-run instead from the RNG as it was when the micro-batch began in the
re-run (the state the step's previous forward left, the one the loss started from in
training), so its draws and its own model call repeat training's.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from recorder.loss_forwards import holds_model

from .load import Step


def _own_outputs(tree: Any, i: int) -> bool:
    """Whether the loss's inputs ``tree`` reference micro-batch ``i``'s own outputs."""
    if isinstance(tree, dict):
        if ("$out" in tree or "$output" in tree) and tree.get("mb", i) == i:
            return True
        return any(_own_outputs(v, i) for v in tree.values())
    if isinstance(tree, list):
        return any(_own_outputs(v, i) for v in tree)
    return False


def forward_in_loss(step: Step, i: int) -> bool:
    """Whether micro-batch ``i`` (not the first) has a loss that holds the model and takes
    none of ``i``'s outputs, and an RNG state of its own: its forward ran inside the loss."""
    entry = step.micro_batches[i]
    if not i or "loss_inputs" not in entry or not entry.get("rng") or not _holds_model(step):
        return False
    return not _own_outputs(entry["loss_inputs"], i)


def _holds_model(step: Step) -> bool:
    """The re-run's loss holds its model: a module with it inside, or a function reading it
    from a global (recorder.loss_forwards.holds_model)."""
    loss, model = step.loss_fn, step.model
    if model is None or loss is None:
        return False
    if isinstance(loss, nn.Module):
        return any(m is model for m in loss.modules())
    return holds_model(step.meta.get("loss"))


def loss_runs_model(step: Step, i: int) -> bool:
    """Whether micro-batch ``i``'s forward ran inside a loss that calls the model itself: the
    loss of ``i``, or of the first micro-batch after it that has one, holds the model and
    takes none of the step's outputs (sentence-transformers' losses, ``Loss(model)``, run the
    model on the anchors and on the positives, two micro-batches, inside one loss call). That
    loss's own backward goes through every such call: their recorded output gradients are no
    second path to add."""
    if not _holds_model(step):
        return False
    entries = step.micro_batches
    j = next((k for k in range(i, len(entries)) if "loss_inputs" in entries[k]), None)
    return j is not None and not any(_own_outputs(entries[j]["loss_inputs"], k)
                                     for k in range(len(entries)))
