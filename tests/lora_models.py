"""LoRA as a parametrization (minLoRA style: ``W + B @ A * alpha / r`` on frozen Linear weights),
with the factory its bundles name (``lora_models:make_lora_mlp``; replayed from this
directory)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize


class LoRA(nn.Module):
    def __init__(self, fan_out: int, fan_in: int, rank: int = 4, alpha: float = 8.0):
        super().__init__()
        self.lora_A = nn.Parameter(torch.randn(rank, fan_in) / rank)
        self.lora_B = nn.Parameter(torch.zeros(fan_out, rank))
        self.scale = alpha / rank

    def forward(self, w):
        return w + self.lora_B @ self.lora_A * self.scale


def make_lora_mlp() -> nn.Module:
    """An MLP whose Linear weights are frozen and adapted by LoRA parametrizations: each
    forward calls ``<i>.parametrizations.weight.0`` (on the weight) before the layer."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                      nn.Linear(64, 4))
    for layer in m.modules():
        if isinstance(layer, nn.Linear):
            parametrize.register_parametrization(layer, "weight", LoRA(*layer.weight.shape))
    for name, p in m.named_parameters():
        p.requires_grad_("lora_" in name)
    return m
