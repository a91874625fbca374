"""The fine-tuning model of ``test_param_groups.py`` (a backbone under a new head, parameter
groups built as Hugging Face scripts build them), importable by the replay as a factory
(``param_groups_models:make``)."""

from __future__ import annotations

import torch
from torch import nn

BACKBONE_LR, HEAD_LR, WD = 1e-5, 1e-3, 0.01


class FineTune(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(),
                                      nn.Linear(16, 16))
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(torch.relu(self.backbone(x)))


def make() -> FineTune:
    torch.manual_seed(0)
    return FineTune()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)


def hf_groups(model: FineTune) -> list[dict]:
    """Backbone weights with decay, the no-decay group of biases and norms, the head's own
    rate: the head's group last."""
    body = list(model.backbone.named_parameters())
    return [{"params": [p for _, p in body if p.ndim >= 2], "lr": BACKBONE_LR,
             "weight_decay": WD},
            {"params": [p for _, p in body if p.ndim < 2], "lr": BACKBONE_LR,
             "weight_decay": 0.0},
            {"params": list(model.head.parameters()), "lr": HEAD_LR, "weight_decay": WD}]
