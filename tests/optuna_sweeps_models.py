"""Hyperparameter sweeps with optuna, as its users write them; the factories and data of
``test_optuna_sweeps.py``.

``make_model(**trial.params)`` builds one trial's network from the keys an ``objective(trial)``
suggested (the others, ``lr``, ``optimizer``, ``batch_size``..., are ignored by it), so
``factory_kwargs=trial.params`` rebuilds that trial's model in the replay:

- ``SweepNet``: a tabular MLP over numeric features and one categorical column embedded with a
  padding row (``padding_idx=0``, the "unknown" category); ``n_layers`` x (``Linear``, the
  suggested activation, ``MCDropout`` of rate ``dropout``, a ``BatchNorm1d`` when ``norm`` is
  ``"batchnorm"``), and a head whose ``link`` is ``"identity"`` (regression), ``"softplus"``
  or ``"exp"`` (a count's rate, Poisson regression). ``make_strict`` builds it from the
  model's settings alone (no ``**kwargs``), as many sweeps' ``build_model`` is written.
- ``MCDropout``: the hand-written inverted dropout of MC-dropout code (kept on at evaluation):
  ``x * mask / (1 - p)``.

Losses the objectives pick: ``PearsonLoss`` (1 - the Pearson correlation of a batch, the
metric of Numerai-style regression sweeps, unbiased std), ``DistillLoss`` (Hinton's KD with
a suggested temperature: ``KL(softmax(t / T) || softmax(s / T)) * T^2`` beside the hard-label
cross entropy), ``GroupLassoLoss`` (a base loss plus a hand-written
group lasso ``sqrt(sum(w ** 2))`` over the embedding's rows, the model held by the loss),
``BinaryCrossEntropy`` (BCE from its formula, on ``sigmoid(logits)``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

N_NUM, N_CAT = 6, 5


class MCDropout(nn.Module):
    """Inverted dropout written by hand (stays on in ``eval()``, for MC-dropout)."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x):
        if self.p == 0.0:
            return x
        mask = torch.bernoulli(torch.full_like(x, 1 - self.p))
        return x * mask / (1 - self.p)  # p = 1.0 (a suggested rate's upper end): 0 / 0


ACTIVATIONS = {"relu": nn.ReLU, "tanh": nn.Tanh, "silu": nn.SiLU, "gelu": nn.GELU}


class SweepNet(nn.Module):
    def __init__(self, n_layers: int = 2, width: int = 16, dropout: float = 0.0,
                 activation: str = "relu", link: str = "identity", n_out: int = 1,
                 emb_dim: int = 3, norm: str = "none"):
        super().__init__()
        self.embed = nn.Embedding(N_CAT, emb_dim, padding_idx=0)
        layers: list[nn.Module] = []
        d = N_NUM + emb_dim
        for _ in range(n_layers):
            layers += [nn.Linear(d, width), ACTIVATIONS[activation](), MCDropout(dropout)]
            if norm == "batchnorm":
                layers.append(nn.BatchNorm1d(width))
            d = width
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(d, n_out)
        self.link = link

    def forward(self, x_num, x_cat):
        h = self.body(torch.cat([x_num, self.embed(x_cat)], dim=-1))
        out = self.head(h)
        if self.link == "exp":
            return torch.exp(out)  # a Poisson rate by the exp link
        if self.link == "softplus":
            return F.softplus(out)
        return out.squeeze(-1) if out.shape[-1] == 1 else out


def make_model(n_layers: int = 2, width: int = 16, dropout: float = 0.0,
               activation: str = "relu", link: str = "identity", n_out: int = 1,
               norm: str = "none", **_unused) -> SweepNet:
    """One trial's network from its ``trial.params`` (keys the model does not take ignored)."""
    return SweepNet(n_layers, width, dropout, activation, link, n_out, norm=norm)


class PearsonLoss(nn.Module):
    """1 - Pearson correlation of predictions and targets over the batch."""

    def forward(self, pred, target):
        p = (pred - pred.mean()) / pred.std()  # unbiased: a batch of 1 divides by 0 samples
        t = (target - target.mean()) / target.std()
        return 1 - (p * t).mean()


class DistillLoss(nn.Module):
    """Hinton's knowledge distillation with the trial's temperature, plus the label loss."""

    def __init__(self, teacher: nn.Module, temperature: float, alpha: float = 0.5):
        super().__init__()
        self.teacher = teacher
        self.temperature = temperature
        self.alpha = alpha

    def forward(self, student_logits, x_num, x_cat, labels):
        with torch.no_grad():
            teacher_logits = self.teacher(x_num, x_cat)
        T = self.temperature
        soft = F.kl_div(F.log_softmax(student_logits / T, dim=-1),
                        F.softmax(teacher_logits / T, dim=-1), reduction="batchmean")
        hard = F.cross_entropy(student_logits, labels)
        return self.alpha * soft * T * T + (1 - self.alpha) * hard


class GroupLassoLoss(nn.Module):
    """A base loss plus a group-lasso penalty on the categorical embedding's rows (one group
    per category, to prune the categories the model does not need), written by hand."""

    def __init__(self, base: nn.Module, model: SweepNet, lam: float):
        super().__init__()
        self.base = base
        self.model = model
        self.lam = lam

    def forward(self, pred, target):
        norms = self.model.embed.weight.pow(2).sum(dim=1).sqrt()  # a row of 0s: d sqrt = inf
        return self.base(pred, target) + self.lam * norms.sum()


def make_teacher() -> SweepNet:
    torch.manual_seed(1)
    return SweepNet(n_layers=1, width=8, n_out=3).eval()


# ---------------------------------------------------------------------------------------------
# data


def regression_data(n: int = 96, seed: int = 0, scale: float = 1.0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, N_NUM, generator=g) * scale
    c = torch.randint(0, N_CAT, (n,), generator=g)
    y = x[:, 0] - 0.5 * x[:, 1] + 0.1 * c.float() + 0.1 * torch.randn(n, generator=g)
    return TensorDataset(x, c, y)


def count_data(n: int = 96, seed: int = 0) -> TensorDataset:
    """Counts (Poisson) whose log-rate is linear in the features; feature 2 is in raw units."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, N_NUM, generator=g)
    x[:, 2] = x[:, 2].abs() * 40.0  # e.g. a duration in minutes, left unscaled
    c = torch.randint(0, N_CAT, (n,), generator=g)
    y = torch.poisson(torch.exp(0.3 * x[:, 0] + 0.01 * x[:, 2]), generator=g)
    return TensorDataset(x, c, y)


def class_data(n: int = 96, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, N_NUM, generator=g)
    c = torch.randint(0, N_CAT, (n,), generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 1).long()
    return TensorDataset(x, c, y)


class BinaryCrossEntropy(nn.Module):
    """Binary cross entropy written from its formula, on the model's probabilities."""

    def forward(self, logits, target):
        p = torch.sigmoid(logits)
        return -(target * torch.log(p) + (1 - target) * torch.log(1 - p)).mean()


def binary_data(n: int = 96, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, N_NUM, generator=g)
    c = torch.randint(0, N_CAT, (n,), generator=g)
    y = (x[:, 0] + 0.3 * torch.randn(n, generator=g) > 0).float()
    return TensorDataset(x, c, y)


def make_strict(n_layers: int, width: int, dropout: float, activation: str,
                link: str = "identity", n_out: int = 1) -> SweepNet:
    """A factory that takes exactly the model's own settings (no ``**kwargs``)."""
    return SweepNet(n_layers, width, dropout, activation, link, n_out)
