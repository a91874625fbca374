"""Metric-learning and multi-task models for ``test_metric_multitask``, written as their
projects write them: a shared trunk with one head per task returning a dict, Kendall et al.'s
learned uncertainty weighting as a loss module whose log-variances the optimizer trains."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MultiTaskNet(nn.Module):
    """A shared trunk, a classification head and a regression head."""

    def __init__(self, d_in: int = 16):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(d_in, 32), nn.ReLU())
        self.cls_head = nn.Linear(32, 5)
        self.reg_head = nn.Linear(32, 1)

    def forward(self, x):
        h = self.trunk(x)
        return {"cls": self.cls_head(h), "reg": self.reg_head(h).squeeze(-1)}


def make_multitask() -> nn.Module:
    torch.manual_seed(0)
    return MultiTaskNet()


class UncertaintyWeighting(nn.Module):
    """Kendall et al. (2018): each task's loss weighted by exp(-log_var), plus log_var."""

    def __init__(self, n_tasks: int = 2):
        super().__init__()
        self.log_vars = nn.Parameter(torch.zeros(n_tasks))

    def forward(self, out, y_cls, y_reg):
        losses = [F.cross_entropy(out["cls"], y_cls), F.mse_loss(out["reg"], y_reg)]
        total = 0
        for i, loss in enumerate(losses):
            total = total + torch.exp(-self.log_vars[i]) * loss + self.log_vars[i]
        return total


def batch(step: int, n: int = 16, d_in: int = 16):
    """Features, class labels and regression targets of one step (the same for every run)."""
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randn(n, d_in, generator=g), torch.randint(0, 5, (n,), generator=g),
            torch.randn(n, generator=g))


class SigmaWeighting(nn.Module):
    """Uncertainty weighting with each task's sigma itself the parameter (a common variant of
    Kendall et al.'s): ``loss / (2 sigma^2) + log(sigma)``, nothing keeping sigma above 0."""

    def __init__(self, n_tasks: int = 2):
        super().__init__()
        self.sigma = nn.Parameter(torch.ones(n_tasks))

    def forward(self, out, y_cls, y_reg):
        losses = [F.cross_entropy(out["cls"], y_cls), F.mse_loss(out["reg"], y_reg)]
        total = 0
        for i, loss in enumerate(losses):
            total = total + loss / (2 * self.sigma[i] ** 2) + torch.log(self.sigma[i])  # BUG log
        return total


class SharedOutputNet(nn.Module):
    """One output tensor for both tasks: columns 0-4 the class logits, column 5 the
    regression (two losses over slices of the same output)."""

    def __init__(self, d_in: int = 16):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(d_in, 32), nn.ReLU())
        self.head = nn.Linear(32, 6)

    def forward(self, x):
        return self.head(self.trunk(x))


def make_shared_output() -> nn.Module:
    torch.manual_seed(0)
    return SharedOutputNet()


class Embedder(nn.Module):
    def __init__(self, d_in: int = 16, d: int = 8):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(d_in, 32), nn.ReLU(), nn.Linear(32, d))

    def forward(self, x):
        return self.backbone(x)


def make_embedder() -> nn.Module:
    torch.manual_seed(0)
    return Embedder()


class PairContrastive(nn.Module):
    """A contrastive loss over the pairs a collate function mined (``(P, 2)`` row indices
    into the batch, and whether each pair is of one class)."""

    def __init__(self, margin: float = 0.5):
        super().__init__()
        self.margin = margin

    def forward(self, emb, pairs, same):
        a, b = emb[pairs[:, 0]], emb[pairs[:, 1]]
        d = (a - b).pow(2).sum(1).sqrt()  # BUG sqrt: its derivative is infinite at 0
        return torch.where(same, d.pow(2), F.relu(self.margin - d).pow(2)).mean()


def all_pairs(items):
    """A collate function: the batch, its labels, every pair of its rows and which are of one
    class."""
    x = torch.stack([a for a, _ in items])
    y = torch.stack([b for _, b in items])
    i, j = torch.triu_indices(len(y), len(y), 1)
    return x, y, torch.stack([i, j], 1), y[i] == y[j]


class LossWrapper(nn.Module):
    """Holds the model and computes its task losses: the loop calls ``wrapper(batch)`` and
    sums the dict it returns."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, batch):
        out = self.model(batch["x"])
        return {"cls": F.cross_entropy(out["cls"], batch["y"]),
                "reg": F.mse_loss(out["reg"], batch["r"])}
