"""Contextual bandits and off-policy evaluation/learning for recommenders, as Open Bandit
Pipeline / ReAgent / recsys practitioners write them, for ``test_bandits_ope`` (at module level
so that ``nanreplay`` rebuilds them from the bundle, ``bandits_ope_models:make_policy``):
a softmax policy over items trained off-policy from logged ``(context, action, reward,
propensity)`` tuples with IPS, self-normalised IPS, clipped IPS and doubly robust objectives
(the latter with a learned reward model); a Plackett-Luce slate policy whose log-probability is
the log of a product of softmax terms over a shrinking candidate set; a neural LinUCB head
whose exploration bonus is ``sqrt(x^T A^-1 x)`` over a Sherman-Morrison-updated inverse; a
TensorDataset of logged batches read by a DataLoader."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

CTX = 12  # context features
ITEMS = 20  # catalogue size (actions)
D = 8
B = 16
SLATE = 4
CAP = 20.0  # weight clipping (the "capped IPS" of Bottou et al. 2013)


class SoftmaxPolicy(nn.Module):
    """pi(a | x) = softmax(u(x) . e_a / temperature): a two-tower scorer over the catalogue."""

    def __init__(self, temperature: float = 1.0):
        super().__init__()
        self.user = nn.Sequential(nn.Linear(CTX, 32), nn.ReLU(), nn.Linear(32, D))
        self.items = nn.Embedding(ITEMS, D)
        self.temperature = temperature

    def forward(self, x, available=None):
        logits = self.user(x) @ self.items.weight.T / self.temperature
        if available is not None:  # items out of stock for that request
            logits = logits.masked_fill(~available, float("-inf"))
        return logits


class RewardModel(nn.Module):
    """q(x, a): the direct-method reward regressor of a doubly robust estimator; one learned
    bias per action (``action_bias``), looked up for the logged actions only."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(CTX, 32), nn.ReLU(), nn.Linear(32, ITEMS))
        self.action_bias = nn.Embedding(ITEMS, 1)

    def forward(self, x, action):
        q_all = self.body(x)
        return q_all.gather(1, action[:, None]).squeeze(1) + self.action_bias(action).squeeze(1)


class DoublyRobust(nn.Module):
    """A policy and its reward model trained together: returns the policy's logits and q(x, a)."""

    def __init__(self):
        super().__init__()
        self.policy = SoftmaxPolicy()
        self.q = RewardModel()

    def forward(self, x, action):
        return self.policy(x), self.q(x, action)


class PlackettLuceSlate(nn.Module):
    """A top-K slate policy: the log-probability of the logged ranking under Plackett-Luce,
    written as the product of its softmax terms over the shrinking candidate set."""

    def __init__(self, temperature: float = 1.0):
        super().__init__()
        self.scorer = nn.Sequential(nn.Linear(CTX, 32), nn.Tanh(), nn.Linear(32, ITEMS))
        self.temperature = temperature

    def forward(self, x, slate):
        s = self.scorer(x) / self.temperature
        e = torch.exp(s - s.max(1, keepdim=True).values)
        remaining = torch.ones_like(s)
        prob = torch.ones(s.shape[0])
        for k in range(slate.shape[1]):
            pick = slate[:, k:k + 1]
            term = e.gather(1, pick).squeeze(1) / (e * remaining).sum(1)
            prob = prob * term
            remaining = remaining.scatter(1, pick, 0.0)
        return torch.log(prob)  # log pi(slate | x)


class NeuralLinUCB(nn.Module):
    """Neural LinUCB (Xu et al. 2022): a learned embedding phi(x, a), a linear reward head, and
    an exploration bonus ``alpha * sqrt(phi^T A^-1 phi)`` over the design matrix's inverse,
    which the loop keeps as a buffer (Sherman-Morrison rank-one updates)."""

    def __init__(self, alpha: float = 1.0, lam: float = 1.0):
        super().__init__()
        self.phi = nn.Sequential(nn.Linear(CTX + ITEMS, 32), nn.ReLU(), nn.Linear(32, D))
        self.head = nn.Linear(D, 1)
        self.alpha = alpha
        self.register_buffer("a_inv", torch.eye(D) / lam)

    def forward(self, x, action):
        f = self.phi(torch.cat([x, F.one_hot(action, ITEMS).float()], 1))
        mean = self.head(f).squeeze(1)
        width = torch.einsum("bi,ij,bj->b", f, self.a_inv, f)
        return mean, mean + self.alpha * width.sqrt()

    @torch.no_grad()
    def update_design(self, x, action):
        """A^-1 <- A^-1 - A^-1 f f^T A^-1 / (1 + f^T A^-1 f), one logged row at a time."""
        f = self.phi(torch.cat([x, F.one_hot(action, ITEMS).float()], 1))
        for v in f:
            av = self.a_inv @ v
            self.a_inv -= torch.outer(av, av) / (1 + v @ av)

    @torch.no_grad()
    def forget(self, x, action):
        """Sliding-window LinUCB: the rank-one downdate of rows leaving the window,
        A^-1 <- A^-1 + A^-1 f f^T A^-1 / (1 - f^T A^-1 f)."""
        f = self.phi(torch.cat([x, F.one_hot(action, ITEMS).float()], 1))
        for v in f:
            av = self.a_inv @ v
            self.a_inv += torch.outer(av, av) / (1 - v @ av)


def make_policy(temperature: float = 1.0):
    torch.manual_seed(0)
    return SoftmaxPolicy(temperature)


def make_dr():
    torch.manual_seed(0)
    return DoublyRobust()


def make_slate(temperature: float = 1.0):
    torch.manual_seed(0)
    return PlackettLuceSlate(temperature)


def make_linucb(lam: float = 1.0):
    torch.manual_seed(0)
    return NeuralLinUCB(lam=lam)


# ---- losses: the off-policy objectives ---------------------------------------------------

def action_prob(logits, action):
    return torch.softmax(logits, 1).gather(1, action[:, None]).squeeze(1)


def ips_loss(logits, action, reward, propensity):
    """-mean(r * pi(a|x) / mu(a|x)): the IPS estimate of the policy's value, maximised."""
    w = action_prob(logits, action) / propensity
    return -(w * reward).mean()


def snips_loss(logits, action, reward, propensity):
    """Self-normalised IPS (Swaminathan & Joachims 2015): sum(w r) / sum(w)."""
    w = action_prob(logits, action) / propensity
    return -(w * reward).sum() / w.sum()


def clipped_ips_loss(logits, action, reward, propensity):
    """Capped IPS, rows with no logged propensity "skipped" with a where."""
    pi = action_prob(logits, action)
    w = torch.where(propensity > 0, pi / propensity, torch.zeros_like(pi))
    return -(w.clamp(max=CAP) * reward).mean()


def snips_log_loss(logits, action, reward, log_propensity):
    """SNIPS from logged log-propensities: w = exp(log pi(a|x) - log mu(a|x))."""
    w = torch.exp(torch.log_softmax(logits, 1).gather(1, action[:, None]).squeeze(1)
                  - log_propensity)
    return -(w * reward).sum() / w.sum()


class DRLoss(nn.Module):
    """Doubly robust policy learning: the reward model's squared error plus the DR value
    ``q(x, pi) + w (r - q(x, a))`` of the policy, maximised."""

    def forward(self, out, action, reward, propensity):
        logits, q = out
        w = action_prob(logits, action) / propensity
        value = (w * (reward - q.detach())).mean() + q.detach().mean()
        return F.mse_loss(q, reward) - value


def slate_pg_loss(log_pi, reward, propensity):
    """Off-policy REINFORCE on slates: -mean(w r log pi) with the importance weight detached."""
    w = (log_pi.detach().exp() / propensity).clamp(max=CAP)
    return -(w * reward * log_pi).mean()


def linucb_loss(out, reward):
    mean, _ = out
    return F.mse_loss(mean, reward)


# ---- logged data --------------------------------------------------------------------------

def logged(n: int, seed: int = 0, slate: bool = False) -> TensorDataset:
    """``n`` logged rounds of a softmax logging policy: context, action (or a slate of
    SLATE distinct items), a Bernoulli click and the logging propensity mu(a | x)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, CTX, generator=g)
    w = torch.randn(CTX, ITEMS, generator=g) * 0.3
    mu = torch.softmax(x @ w, 1)
    if slate:
        action = torch.multinomial(mu, SLATE, replacement=False, generator=g)
        prop = torch.full((n,), 1.0)
        rest = mu.clone()
        for k in range(SLATE):
            p = rest.gather(1, action[:, k:k + 1]).squeeze(1) / rest.sum(1)
            prop = prop * p
            rest = rest.scatter(1, action[:, k:k + 1], 0.0)
    else:
        action = torch.multinomial(mu, 1, generator=g).squeeze(1)
        prop = mu.gather(1, action[:, None]).squeeze(1)
    reward = (torch.rand(n, generator=g) < 0.3).float()
    return TensorDataset(x, action, reward, prop)


def loader(data: TensorDataset, batch_size: int = B) -> DataLoader:
    return DataLoader(data, batch_size=batch_size, shuffle=False)
