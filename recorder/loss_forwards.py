"""Micro-batches whose forward ran inside a loss call: a loss module that holds the model (or a
loss function that reads it from a global of its module) and calls it itself (WGAN-GP's critic on the interpolates, a consistency loss's strong view,
``autograd.functional.hvp`` of the model, sentence-transformers' ``Loss(model)``). The recorder
numbers every call of the model a micro-batch, so a loop with one forward reads as micro-batches
0 and 1, and the loss is filed under the last call it made: the event's message and the
replay's report say which call that micro-batch is. Read from the bundle's JSON (its
``micro_batches`` and ``loss``), so both sides tell it the same way."""

from __future__ import annotations

from typing import Any

__all__ = ["forward_in_loss_phrase", "holds_model", "ran_in_loss", "taken_outputs"]


def taken_outputs(tree: Any, filed: int) -> set[int]:
    """The micro-batches whose outputs the loss inputs ``tree`` (of the loss filed under
    micro-batch ``filed``) reference: ``{"$out": j}`` or ``{"$output": true}``, with ``"mb"``
    for an earlier micro-batch's."""
    if isinstance(tree, dict):
        own = {tree.get("mb", filed)} if "$out" in tree or "$output" in tree else set()
        return own.union(*(taken_outputs(v, filed) for v in tree.values()))
    if isinstance(tree, list):
        return set().union(*(taken_outputs(v, filed) for v in tree))
    return set()


def holds_model(loss: dict[str, Any] | None) -> bool:
    """Whether the bundle's loss description holds the recorded model itself: a module with a
    node of its tree shared with the model's root, or a function reading it from a global
    (``model_globals``)."""
    def holds(node: Any) -> bool:
        return isinstance(node, dict) and (node.get("model") == "" or any(
            holds(c) for c in (node.get("children") or {}).values()))
    if not loss:
        return False
    if loss.get("kind") == "function":
        return bool(loss.get("model_globals"))
    return loss.get("kind") == "module" and holds(loss.get("tree"))


def ran_in_loss(micro_batches: list[dict[str, Any]], loss: dict[str, Any] | None,
                i: int | None) -> bool:
    """Whether micro-batch ``i``'s forward ran inside the loss: the loss holds the model, and
    the loss call filed under ``i`` (or under the first later micro-batch with one) took none
    of ``i``'s outputs; the first micro-batch only when that loss took no output at all (a
    loss given the model output, even reshaped, is the loop's own forward's)."""
    if i is None or not 0 <= i < len(micro_batches) or not holds_model(loss):
        return False
    j = next((k for k in range(i, len(micro_batches)) if "loss_inputs" in micro_batches[k]),
             None)
    if j is None:
        return False
    taken = taken_outputs(micro_batches[j]["loss_inputs"], j)
    return i not in taken and (i > 0 or not taken)


def forward_in_loss_phrase(mb: int | None, in_loss: bool) -> str:
    """Micro-batch ``mb`` as the texts name it, with what it is when it ran in the loss."""
    return f"micro-batch {mb}" + (", the loss's own call of the model" if in_loss else "")
