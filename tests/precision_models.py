"""Models trained in a reduced precision outright (``model.to(torch.bfloat16)``, no autocast), as
long runs do to halve their memory, with a float32 master copy of the weights kept by hand."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

D_IN, HIDDEN, N_CLASSES = 16, 32, 3


class TemperatureClassifier(nn.Module):
    """A classifier whose log-softmax at a low temperature is written by hand: ``exp`` of the
    sharpened logits, with no row maximum subtracted."""

    def __init__(self, temperature: float = 0.01):
        super().__init__()
        self.fc1 = nn.Linear(D_IN, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, N_CLASSES)
        self.temperature = temperature

    def forward(self, x):
        z = self.fc2(F.gelu(self.fc1(x))) / self.temperature
        return z - torch.log(torch.exp(z).sum(-1, keepdim=True))  # BUG: exp overflows


def make_bf16_classifier() -> nn.Module:
    torch.manual_seed(0)
    return TemperatureClassifier().to(torch.bfloat16)
