"""Models that share weights (``test_tied_weights``): a small language model whose output
projection is tied to the token embedding by the training script after it builds the model
(``Untied``) or by the class itself (``Tied``, nanoGPT's ``self.lm_head.weight =
self.tok_emb.weight``), the functional form ``h @ self.emb.weight.T``, one residual block
applied four times per forward (ALBERT, Universal Transformers) and a siamese encoder."""

from __future__ import annotations

import torch
from torch import nn

VOCAB, DIM = 16, 8


class Untied(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, DIM)
        self.fc = nn.Linear(DIM, DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx):
        h = torch.tanh(self.fc(self.tok_emb(idx)))
        return self.lm_head(h)


class Tied(Untied):
    def __init__(self):
        super().__init__()
        self.lm_head.weight = self.tok_emb.weight


class FunctionalTied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, idx):
        h = torch.tanh(self.fc(self.emb(idx)))
        return h @ self.emb.weight.T


class ExpBlock(nn.Module):
    def __init__(self, dim=DIM):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return x + torch.exp(self.fc(x))


class SharedBlock(nn.Module):
    """One block, applied ``depth`` times."""

    def __init__(self, depth=3):
        super().__init__()
        self.block = ExpBlock()
        self.depth = depth
        self.head = nn.Linear(DIM, 3)

    def forward(self, x):
        h = x
        for _ in range(self.depth):
            h = self.block(h)
        return self.head(h)


class Siamese(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(6, 4)

    def forward(self, a, b):
        return (self.enc(a) - self.enc(b)).pow(2).sum(-1)
