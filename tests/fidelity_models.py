"""A model built from run-time configuration, as training scripts build theirs: ``train.py``
parses ``--scale`` into ``CONFIG`` and the factory reads it, so a replay in a fresh process
(``CONFIG`` at its default) builds a different model unless the value is handed back to the
factory (``factory_kwargs``)."""

from __future__ import annotations

import replay_models as R
from torch import nn

CONFIG = {"scale": 1.0}  # set from the command line by the training script


class Scale(nn.Module):
    def __init__(self, value: float):
        super().__init__()
        self.value = value

    def forward(self, x):
        return x * self.value


class ScaledLogNet(nn.Module):
    """``replay_models.LogNet`` with its hidden features scaled by a configured factor."""

    def __init__(self, scale: float):
        super().__init__()
        self.lin = nn.Linear(R.D_IN, R.HIDDEN)
        self.scale = Scale(scale)
        self.act = R.ShiftedLog()
        self.head = nn.Linear(R.HIDDEN, R.N_CLASSES)

    def forward(self, x):
        return self.head(self.act(self.scale(self.lin(x))))


def make_scaled_net(scale: float | None = None) -> nn.Module:
    """The factory: the scale from the keyword argument, else from the global config."""
    return ScaledLogNet(CONFIG["scale"] if scale is None else scale)
