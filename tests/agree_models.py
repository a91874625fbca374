"""Tiny models for tests/test_report_agrees.py: a row normaliser without eps, an MLP, a token
classifier (an embedding some of whose rows no batch reads)."""

from __future__ import annotations

import torch
from torch import nn

BATCH, FEATURES, CLASSES, TOKENS = 8, 6, 3, 16


class RowNorm(nn.Module):
    def forward(self, x):
        return (x - x.mean(1, keepdim=True)) / x.std(1, keepdim=True)  # 0/0 on a constant row


class Normed(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = RowNorm()
        self.fc = nn.Linear(FEATURES, CLASSES)

    def forward(self, x):
        return self.fc(self.norm(x))


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, 8)
        self.fc2 = nn.Linear(8, CLASSES)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Tokens(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(TOKENS, 4)
        self.fc = nn.Linear(4, CLASSES)

    def forward(self, idx):
        return self.fc(self.emb(idx).mean(1))


def make_normed():
    return Normed()


def make_mlp():
    return Mlp()


def make_tokens():
    return Tokens()


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(BATCH, FEATURES, generator=g).abs() + 0.1,
            torch.randint(0, CLASSES, (BATCH,), generator=g))


def token_batch(seed: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, vocab, (BATCH, 5), generator=g),
            torch.randint(0, CLASSES, (BATCH,), generator=g))
