"""One loss over several forwards: a triplet loss over ``model(a)``, ``model(p)``,
``model(n)``, a Siamese pair's two calls. The recorder keeps one micro-batch per forward and
the loss in the last one; an earlier forward's output reaches the re-run loss detached, its
gradient fed back from its recorded output gradient when its own backward runs. Where that
gradient is non-finite (the loss made it: the sqrt of a distance between two equal
embeddings), it is not fed, and the re-run loss is back-propagated into that forward's graph
instead (still alive: nothing ran backward through it), so the loss's node that made the
value runs, and is found, as in training."""

from __future__ import annotations

from typing import Any

import torch

from recorder.finite import finite

from .load import Step


def taken_outputs(tree: Any) -> set[int]:
    """The micro-batches (other than the loss's own) whose outputs a recorded loss argument
    tree takes (its ``{"$out": j, "mb": k}`` nodes)."""
    found: set[int] = set()
    if isinstance(tree, dict):
        if "$out" in tree and isinstance(tree.get("mb"), int):
            found.add(tree["mb"])
        for v in tree.values():
            found |= taken_outputs(v)
    elif isinstance(tree, list):
        for v in tree:
            found |= taken_outputs(v)
    return found


def taken_later(step: Step, k: int) -> bool:
    """A later micro-batch's loss takes micro-batch ``k``'s outputs."""
    return any(k in taken_outputs(mb.get("loss_inputs"))
               for mb in step.micro_batches[k + 1:] if isinstance(mb, dict))


def left_unfed(step: Step, k: int, loss, grads: dict[int, torch.Tensor]) -> bool:
    """Micro-batch ``k`` ran no loss of its own, its recorded output gradient is non-finite
    (so it is not fed), and a later loss takes its outputs: that loss's backward reaches it."""
    return loss is None and bool(grads) and not all(finite(g) for g in grads.values()) \
        and taken_later(step, k)


def takes_unfed(step: Step, i: int, unfed: set[int]) -> bool:
    """Micro-batch ``i``'s loss takes outputs of a micro-batch left unfed."""
    return bool(unfed) and bool(taken_outputs(step.micro_batches[i].get("loss_inputs"))
                                & unfed)
