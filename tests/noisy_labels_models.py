"""Learning with noisy labels, written as the reference repositories write it (SCE's and
APL's ``losses.py``, GCE, Co-teaching's ``loss_coteaching``, DivideMix's per-sample losses,
forward correction with an estimated transition matrix), for ``test_noisy_labels``.

- ``Net``: the small MLP classifier (BatchNorm, dropout) the losses train; ``SubsetNet``:
  its logits masked with -inf outside the classes a record's source labels (an extra
  ``forward`` argument), for a union of web datasets.
- ``SCELoss``: symmetric cross entropy, ``alpha CE + beta RCE``; RCE's ``log`` of the one-hot
  labels must be clamped (``A = log(1e-4) = -4``) or it is ``log 0``.
- ``GCELoss``: generalized cross entropy ``(1 - p_y^q) / q`` over softmax probabilities
  clamped to ``[1e-7, 1]`` (the clamp keeps ``p^q``'s gradient at 0 finite).
- ``NCEandRCE``: APL's active-passive loss (normalised CE plus RCE).
- ``ForwardCorrected``: forward correction, ``nll(log(softmax(logits) @ T), noisy y)``, with
  the transition matrix ``T`` estimated from anchor points (a buffer).
- ``CoTeachingPair`` + ``coteaching_loss``: two networks exchanging their small-loss samples,
  ``num_remember = int((1 - forget_rate) * len(batch))``.
- ``NoiseAdaptation``: Goldberger & Ben-Reuven's noise adaptation layer, a learned
  transition ``softmax(W)`` started at the log of an estimate.
- ``BootstrapLoss``: hard bootstrapping, ``beta y + (1 - beta) argmax p`` as the target.
- ``gmm_clean_prob``: DivideMix's two-component GMM on the per-sample losses, in torch;
  ``refined_ce``: its label refinement by each record's clean probability.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

CLASSES, DIM = 6, 12


class Net(nn.Module):
    def __init__(self, dim: int = DIM, hidden: int = 32, classes: int = CLASSES,
                 norm: bool = True):
        super().__init__()
        bn = nn.BatchNorm1d(hidden) if norm else nn.Identity()
        self.body = nn.Sequential(nn.Linear(dim, hidden), bn, nn.ReLU(),
                                  nn.Dropout(0.1), nn.Linear(hidden, hidden), nn.ReLU())
        self.fc = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.fc(self.body(x))


def make_net() -> Net:
    torch.manual_seed(0)
    return Net()


def make_plain_net() -> Net:
    """Without BatchNorm (a batch of one sample trains too)."""
    torch.manual_seed(0)
    return Net(norm=False)


class SubsetNet(Net):
    """A classifier trained on a union of noisy web datasets, each labelling a subset of the
    classes: the classes a record's source never uses are masked out of its logits (-inf),
    an extra ``forward`` argument."""

    def forward(self, x, valid):
        return super().forward(x).masked_fill(~valid, float("-inf"))


def make_subset_net() -> SubsetNet:
    torch.manual_seed(0)
    return SubsetNet()


class SCELoss(nn.Module):
    """Wang et al. 2019 (github.com/HanxunH/SCELoss-Reproduce)."""

    def __init__(self, alpha: float = 0.1, beta: float = 1.0, clamp: bool = True):
        super().__init__()
        self.alpha, self.beta, self.clamp = alpha, beta, clamp

    def forward(self, pred, labels):
        ce = F.cross_entropy(pred, labels)
        pred = F.softmax(pred, dim=1).clamp(min=1e-7, max=1.0)
        label_one_hot = F.one_hot(labels, pred.shape[1]).float()
        if self.clamp:  # log(1e-4) = -4: the paper's A
            label_one_hot = torch.clamp(label_one_hot, min=1e-4, max=1.0)
        rce = -1 * torch.sum(pred * torch.log(label_one_hot), dim=1)  # the bug: log 0 unclamped
        return self.alpha * ce + self.beta * rce.mean()


class GCELoss(nn.Module):
    """Zhang & Sabuncu 2018, as APL's ``losses.py`` writes it."""

    def __init__(self, q: float = 0.7, clamp: bool = True):
        super().__init__()
        self.q, self.clamp = q, clamp

    def forward(self, pred, labels):
        pred = F.softmax(pred, dim=1)
        if self.clamp:
            pred = torch.clamp(pred, min=1e-7, max=1.0)
        p_y = torch.gather(pred, 1, labels[:, None]).squeeze(1)
        gce = (1.0 - p_y ** self.q) / self.q  # the bug: p_y = 0 without the clamp
        return gce.mean()


class NCEandRCE(nn.Module):
    """Ma et al. 2020's active-passive loss: normalised CE (CE over the sum of every class's
    CE) plus reverse CE."""

    def __init__(self, alpha: float = 1.0, beta: float = 1.0):
        super().__init__()
        self.alpha, self.beta = alpha, beta

    def forward(self, pred, labels):
        logp = F.log_softmax(pred, dim=1)
        one_hot = F.one_hot(labels, pred.shape[1]).float()
        nce = -1 * torch.sum(one_hot * logp, dim=1) / (-logp.sum(dim=1))
        p = F.softmax(pred, dim=1).clamp(min=1e-7, max=1.0)
        rce = -1 * torch.sum(p * torch.log(one_hot.clamp(min=1e-4, max=1.0)), dim=1)
        return self.alpha * nce.mean() + self.beta * rce.mean()


class ForwardCorrected(nn.Module):
    """Patrini et al. 2017's forward correction: the model's clean-class posterior pushed
    through the noise transition matrix ``T[i, j] = P(noisy j | clean i)`` before the NLL."""

    def __init__(self, transition: torch.Tensor):
        super().__init__()
        self.register_buffer("T", transition)

    def forward(self, logits, noisy_labels):
        noisy_prob = F.softmax(logits, dim=1) @ self.T
        return F.nll_loss(torch.log(noisy_prob), noisy_labels)  # the bug: a zero column of T


def estimate_transition(clean: torch.Tensor, noisy: torch.Tensor,
                        classes: int = CLASSES) -> torch.Tensor:
    """Gold loss correction's estimate from a trusted subset: the row-normalised counts of
    (clean, noisy) label pairs. A noisy class the subset never holds is a zero column."""
    counts = torch.zeros(classes, classes)
    counts.index_put_((clean, noisy), torch.ones(len(clean)), accumulate=True)
    return counts / counts.sum(1, keepdim=True).clamp_min(1)


class NoiseAdaptation(nn.Module):
    """Goldberger & Ben-Reuven 2017's noise adaptation layer: the classifier's clean posterior
    through a learned transition ``softmax(W)``, initialised at the log of an estimate; the
    model returns the log of the noisy-label posterior, trained by NLL."""

    def __init__(self, transition: torch.Tensor):
        super().__init__()
        self.base = Net()
        self.W = nn.Parameter(torch.log(transition))  # the bug: log 0 of a zero column

    def forward(self, x):
        noisy_prob = F.softmax(self.base(x), dim=1) @ F.softmax(self.W, dim=1)
        return torch.log(noisy_prob)


def make_noise_adaptation() -> NoiseAdaptation:
    """T from the trusted subset that holds no record of noisy class 5 (as the test builds
    it)."""
    _, noisy, clean = noisy_dataset(400, seed=1)
    keep = (torch.arange(400) < 60) & (noisy != 5)
    torch.manual_seed(0)
    return NoiseAdaptation(estimate_transition(clean[keep], noisy[keep]))


class BootstrapLoss(nn.Module):
    """Reed et al. 2015's hard bootstrapping."""

    def __init__(self, beta: float = 0.8):
        super().__init__()
        self.beta = beta

    def forward(self, logits, labels):
        ce_label = F.cross_entropy(logits, labels, reduction="none")
        ce_pred = F.cross_entropy(logits, logits.detach().argmax(1), reduction="none")
        return (self.beta * ce_label + (1 - self.beta) * ce_pred).mean()


class CoTeachingPair(nn.Module):
    """Han et al. 2018's two peer networks, trained together (one optimizer over both)."""

    def __init__(self):
        super().__init__()
        self.net1, self.net2 = Net(norm=False), Net(norm=False)

    def forward(self, x):
        return self.net1(x), self.net2(x)


def make_pair() -> CoTeachingPair:
    torch.manual_seed(0)
    return CoTeachingPair()


def coteaching_loss(y_1, y_2, t, forget_rate: float):
    """The reference ``loss_coteaching``: each network keeps its small-loss samples and hands
    them to its peer."""
    loss_1 = F.cross_entropy(y_1, t, reduction="none")
    ind_1_sorted = torch.argsort(loss_1.detach())
    loss_2 = F.cross_entropy(y_2, t, reduction="none")
    ind_2_sorted = torch.argsort(loss_2.detach())
    remember_rate = 1 - forget_rate
    num_remember = int(remember_rate * len(ind_1_sorted))  # the bug: 0 for a small batch
    ind_1_update, ind_2_update = ind_1_sorted[:num_remember], ind_2_sorted[:num_remember]
    loss_1_update = F.cross_entropy(y_1[ind_2_update], t[ind_2_update])
    loss_2_update = F.cross_entropy(y_2[ind_1_update], t[ind_1_update])
    return loss_1_update + loss_2_update


def forget_schedule(forget_rate: float, num_gradual: int, n_epoch: int) -> list[float]:
    rates = [forget_rate] * n_epoch
    for e in range(min(num_gradual, n_epoch)):
        rates[e] = forget_rate * e / num_gradual
    return rates


def gmm_clean_prob(losses: torch.Tensor, iters: int = 10, reg: float = 0.0) -> torch.Tensor:
    """DivideMix's ``GaussianMixture(n_components=2, reg_covar=5e-4)`` on min-max normalised
    per-sample losses, by EM in torch: the posterior of the low-mean (clean) component."""
    x = (losses - losses.min()) / (losses.max() - losses.min())
    mu = torch.stack([x.min(), x.max()])
    var = x.var().expand(2).clone() + reg
    pi = torch.full((2,), 0.5)
    for _ in range(iters):
        logp = -0.5 * (x[:, None] - mu) ** 2 / var - 0.5 * torch.log(2 * torch.pi * var)
        resp = torch.softmax(logp + pi.log(), dim=1)
        nk = resp.sum(0)
        mu = (resp * x[:, None]).sum(0) / nk
        var = (resp * (x[:, None] - mu) ** 2).sum(0) / nk + reg
        pi = nk / len(x)
    return resp[:, mu.argmin()]


def refined_ce(logits, labels, w):
    """DivideMix's label refinement on the labelled set: the given label mixed with the
    model's own prediction by each record's clean probability ``w``, then soft-target CE."""
    one_hot = F.one_hot(labels, logits.shape[1]).float()
    targets = w[:, None] * one_hot + (1 - w[:, None]) * F.softmax(logits, 1).detach()
    return -(targets * F.log_softmax(logits, 1)).sum(1).mean()


# ---------------------------------------------------------------------------------------------
# data: Gaussian class clusters, 30% symmetric label noise


def noisy_dataset(n: int = 200, seed: int = 0, noise: float = 0.3):
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(CLASSES, DIM, generator=g) * 2
    clean = torch.randint(0, CLASSES, (n,), generator=g)
    x = centres[clean] + torch.randn(n, DIM, generator=g)
    flip = torch.rand(n, generator=g) < noise
    noisy = torch.where(flip, torch.randint(0, CLASSES, (n,), generator=g), clean)
    return x, noisy, clean
