"""A loss module that holds the model and runs it itself, as sentence-transformers' losses do
(``MultipleNegativesRankingLoss(model)`` embeds the anchors and the positives inside its own
call): one or two model calls per loss call, on a dict of features. ``trap`` adds a term whose
backward is NaN in the first embedding column only (sqrt at 0)."""

from __future__ import annotations

import torch
from torch import nn


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, features):
        return {"embedding": self.fc(features["x"])}


class PairLoss(nn.Module):
    def __init__(self, model, calls: int = 2):
        super().__init__()
        self.model, self.calls = model, calls

    def forward(self, features, labels, trap: bool = False):
        emb = self.model(features)["embedding"]
        loss = ((emb.sum(-1) - labels) ** 2).mean()
        if self.calls == 2:  # (the positives: the batch reversed)
            pos = self.model({"x": features["x"].flip(0)})["embedding"]
            loss = loss + (emb * pos).mean()
        if trap:
            loss = loss + torch.sqrt((emb[:, 0] - emb[:, 0].detach()) ** 2).mean()
        return loss


def make_model():
    torch.manual_seed(0)
    return Encoder()


def make_one_call():
    model = make_model()
    return {"model": model, "loss_fn": PairLoss(model, calls=1)}


def make_two_calls():
    model = make_model()
    return {"model": model, "loss_fn": PairLoss(model, calls=2)}


def batch(step: int):
    g = torch.Generator().manual_seed(step)
    return {"x": torch.randn(16, 8, generator=g)}, torch.randn(16, generator=g)
