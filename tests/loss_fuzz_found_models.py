"""Models of the loss fuzz's findings: an embedder a triplet loss calls three times per step,
and a frame classifier trained with CTC on a time-major ``(T, B, F)`` batch."""

import functools

import torch
from torch import nn


class Embedder(nn.Module):
    def __init__(self, d=8, h=16, e=8):
        super().__init__()
        self.body = nn.Linear(d, h)
        self.head = nn.Linear(h, e)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


def triplet_loss(anchor, positive, negative, margin=1.0):
    d_ap = ((anchor - positive) ** 2).sum(1).sqrt()  # the bug: no eps under the root
    d_an = ((anchor - negative) ** 2).sum(1).sqrt()
    return torch.relu(d_ap - d_an + margin).mean()


class FrameTagger(nn.Module):
    def __init__(self, d=8, h=16, n_labels=5):
        super().__init__()
        self.body = nn.Linear(d, h)
        self.head = nn.Linear(h, n_labels)

    def forward(self, x):  # (T, B, F) -> (T, B, C) log-probabilities, as CTCLoss takes them
        return self.head(torch.relu(self.body(x))).log_softmax(2)


def make_embedder():
    return Embedder()


def make_tagger():
    return FrameTagger()


def decayed_nll(out, y, params=(), decay=1e-4):
    """A hand-written log-softmax NLL plus an L2 penalty over the weights it is given."""
    nll = -torch.log(torch.softmax(out, -1).gather(1, y[:, None])).mean()
    return nll + decay * sum(p.pow(2).sum() for p in params)


def make_decayed():
    """The model and its loss, which holds the weights to decay (no biases) itself."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    return {"model": model, "loss_fn": functools.partial(decayed_nll, params=weights)}
