"""A model's training mode set for a re-run, also where ``train()`` refuses: the module of
``torch.export.export(...).module()`` raises ``NotImplementedError`` from ``train()`` and
``eval()`` (its dropout and norms' mode was fixed in the graph at export), so its modules'
``training`` flags, which the loop could not change either, are set directly."""

from __future__ import annotations

from torch import nn


def set_training(model: nn.Module, training: bool) -> None:
    """``model.train(training)``, or each module's flag where that call is refused."""
    try:
        model.train(training)
    except NotImplementedError:
        for m in model.modules():
            m.training = training
