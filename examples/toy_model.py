"""A small real classifier with a planted bug: a hand-written normaliser without an epsilon.

``(x - mean) / std`` is 0/0 for a sample whose features are all equal, such as a blank record
that the data pipeline filled with zeros; one such sample turns the whole loss into NaN.
"""

from torch import nn


class UnsafeNorm(nn.Module):
    """Per-sample standardisation, written the way people write it before it bites them."""

    def forward(self, x):  # (B, C)
        mean = x.mean(dim=-1, keepdim=True)
        std = x.std(dim=-1, keepdim=True)
        return (x - mean) / std  # the bug: no eps, 0/0 when a row is constant


class Classifier(nn.Module):
    def __init__(self, d_in: int = 32, d_hidden: int = 64, n_classes: int = 4):
        super().__init__()
        self.norm = UnsafeNorm()
        self.encoder = nn.Sequential(nn.Linear(d_in, d_hidden), nn.ReLU(),
                                     nn.Linear(d_hidden, d_hidden), nn.ReLU())
        self.head = nn.Linear(d_hidden, n_classes)

    def forward(self, x):
        return self.head(self.encoder(self.norm(x)))


def make_model() -> nn.Module:
    """The factory the recorder names, so ``nanreplay`` can rebuild the model."""
    return Classifier()
