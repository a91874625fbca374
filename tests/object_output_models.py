"""A model that returns an object of its own class (not a tensor, container, dataclass or
distribution): a prediction with a mean and a scale, as probabilistic heads are often written."""

import torch
from torch import nn


class Prediction:
    def __init__(self, mean, scale):
        self.mean, self.scale = mean, scale


class ScaledHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 2)

    def forward(self, x):
        h = self.body(x)
        # BUG: normalised by the batch's total activity, 0 when every record is blank, and the
        # weight that should have been 0 only for blank records multiplies every row
        weight = x[:, 0].abs().sum()
        return Prediction(h[:, 0], torch.nn.functional.softplus(h[:, 1]) / weight * 0)


def make_head() -> nn.Module:
    torch.manual_seed(0)
    return ScaledHead()


def gaussian_nll(pred: Prediction, y: torch.Tensor) -> torch.Tensor:
    return (0.5 * (pred.mean - y) ** 2 / (pred.scale + 1) + 0.5 * torch.log1p(pred.scale)).mean()
