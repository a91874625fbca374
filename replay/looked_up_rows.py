"""What a module took as its input when the model's forward is re-run on the bundle's batch,
and which rows of an embedding table that batch looked up.

An update that breaks only the rows of an embedding whose gradient was all 0 (Adam with
``eps=0``: m / sqrt(v) = 0/0) is not only breaking rows absent from the batch: a row the batch
looked up only at positions whose output the loss never reached (padding ids zeroed by
``embed(ids) * mask`` instead of ``padding_idx``, tokens cut off before the loss) gets a
gradient of 0 too. The hint says which is which; the ids are the table's own input, taken by
re-running the forward to it (the buffers it may write put back after).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .load import Step, autocast_as_recorded, micro_batch_inputs

TABLES = (nn.Embedding, nn.EmbeddingBag)


def owner_of(step: Step, name: str) -> nn.Module | None:
    """The module of ``step.model`` that holds parameter ``name``; None when there is none."""
    model, owner = step.model, name.rpartition(".")[0]
    try:
        return model.get_submodule(owner) if model is not None and owner else None
    except AttributeError:
        return None


def forward_taking(step: Step, module: nn.Module, took: Callable[[nn.Module, tuple], None]
                   ) -> bool:
    """Re-run the model's forward on every micro-batch of the bundle (no gradients) with
    ``took`` as a forward pre-hook of ``module``; the model's buffers as the bundle holds them
    after. False when the forward cannot run (one that needs the loop's state)."""
    model = step.model
    kept = {n: b.detach().clone() for n, b in model.named_buffers()}
    handle = module.register_forward_pre_hook(took)
    try:
        with torch.no_grad():
            for i, mb in enumerate(step.micro_batches):
                args, kwargs = micro_batch_inputs(step, i)
                with autocast_as_recorded(mb, step.device):
                    model(*args, **kwargs)
        return True
    except Exception:
        return False
    finally:
        handle.remove()
        with torch.no_grad():  # (a BatchNorm's running statistics: as the bundle holds them)
            for n, b in model.named_buffers():
                if n in kept and kept[n].shape == b.shape:
                    b.copy_(kept[n])


def looked_up_rows(step: Step, name: str) -> set[int] | None:
    """The rows of embedding table ``name`` (an ``nn.Embedding``'s or ``EmbeddingBag``'s
    ``weight``) that the bundle's batch looked up; None for any other parameter, or when the
    forward cannot be re-run to the table."""
    module = owner_of(step, name)
    if not isinstance(module, TABLES) or not name.endswith(".weight"):
        return None
    seen: list[torch.Tensor] = []

    def took(_module, args):
        ids = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if ids is not None and not ids.is_floating_point():
            seen.append(ids.detach().flatten().unique().cpu())

    if not forward_taking(step, module, took) or not seen:
        return None
    return set(torch.cat(seen).tolist())
