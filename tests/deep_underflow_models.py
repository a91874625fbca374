"""Models whose planted bug is a value positive in exact arithmetic that underflows to 0 in
float64 as well, then divided or logged (``tests/test_deep_underflow.py``): a mixture of
experts' sigmoid router scores renormalised over the top-k, a likelihood of many independent
probabilities normalised over the classes; and the same router over ReLU scores, whose 0 is
exact. Every weight that meets the data is initialised positive, so a record of large
negative features drives every score of its row far below 0 (the plant)."""

from __future__ import annotations

import torch
from torch import nn

D_IN, EXPERTS, TOP_K, CLASSES, FEATURES = 4, 4, 2, 3, 16


def _positive(linear: nn.Linear) -> nn.Linear:
    with torch.no_grad():
        linear.weight.uniform_(0.5, 1.0)
        linear.bias.zero_()
    return linear


class TopKRouter(nn.Module):
    """DeepSeek-V3-style routing: sigmoid (or ReLU) affinities, the top-k kept and
    renormalised to sum to 1, the experts' outputs mixed with those weights."""

    def __init__(self, scores: str = "sigmoid"):
        super().__init__()
        self.gate = _positive(nn.Linear(D_IN, EXPERTS))
        self.experts = nn.ModuleList(nn.Linear(D_IN, 2) for _ in range(EXPERTS))
        self.scores = torch.sigmoid if scores == "sigmoid" else torch.relu

    def forward(self, x):
        s = self.scores(self.gate(x))
        w, idx = s.topk(TOP_K, dim=-1)
        w = w / w.sum(-1, keepdim=True)  # BUG: renormalised in probability space
        outs = torch.stack([e(x) for e in self.experts], 1)
        picked = outs.gather(1, idx[..., None].expand(-1, -1, outs.shape[-1]))
        return (w[..., None] * picked).sum(1)


class MoENet(nn.Module):
    def __init__(self, scores: str = "sigmoid"):
        super().__init__()
        self.moe = TopKRouter(scores)
        self.head = nn.Linear(2, 2)

    def forward(self, x):
        return self.head(self.moe(x))


class ProductLikelihood(nn.Module):
    """A class posterior of independent Bernoulli-like features: the product of FEATURES
    sigmoid probabilities per class, normalised over the classes."""

    def __init__(self):
        super().__init__()
        self.lin = _positive(nn.Linear(D_IN, CLASSES * FEATURES))

    def forward(self, x):
        p = torch.sigmoid(self.lin(x)).view(x.shape[0], CLASSES, FEATURES)
        lik = p.prod(-1)
        return lik / lik.sum(-1, keepdim=True)  # BUG: normalised in probability space


class PosteriorNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.posterior = ProductLikelihood()

    def forward(self, x):
        return self.posterior(x)


def make_sigmoid_moe():
    torch.manual_seed(0)
    return MoENet("sigmoid")


def make_relu_moe():
    torch.manual_seed(0)
    return MoENet("relu")


def make_product_posterior():
    torch.manual_seed(0)
    return PosteriorNet()
