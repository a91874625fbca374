"""The model of ``test_grad_unfreeze.py``: an embedding, a stack of residual blocks and a head,
fine-tuned ULMFiT-style (the blocks unfrozen one by one from the top) under layer-wise
learning-rate decay, one parameter group per layer and per decay/no-decay; importable by the
replay as a factory (``grad_unfreeze_models:make``)."""

from __future__ import annotations

import torch
from torch import nn

BLOCKS, LR, DECAY, WD = 3, 1e-3, 0.8, 0.01


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return x + torch.relu(self.norm(self.fc(x)))


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(Block(16) for _ in range(BLOCKS))
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def make() -> Tower:
    torch.manual_seed(0)
    return Tower()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)


def layers(model: Tower) -> list[nn.Module]:
    """From the head down: the order of LLRD's depths and of unfreezing."""
    return [model.head, *reversed(model.blocks), model.embed]


def llrd_groups(layer: nn.Module, depth: int) -> list[dict]:
    """``layer``'s two groups at ``LR * DECAY**depth``: weights with decay, then biases and
    norms without."""
    named = list(layer.named_parameters())
    lr = LR * DECAY ** depth
    return [{"params": [p for _, p in named if p.ndim >= 2], "lr": lr, "weight_decay": WD},
            {"params": [p for _, p in named if p.ndim < 2], "lr": lr, "weight_decay": 0.0}]
