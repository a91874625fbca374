"""Evolution strategies written in torch as OpenAI-ES, NES and estorch write them, for
``test_evolution_strategies``.

- ``Policy``: a small tanh MLP controlling a batch of point masses (a vectorised reaching
  environment, ``rollout``); OpenAI-ES perturbs its flattened parameter vector with antithetic
  Gaussian noise (``parameters_to_vector`` / ``vector_to_parameters``), scores each
  perturbation by an episode under ``no_grad``, shapes the fitness by ``(f - mean) / std`` or
  by centred ranks, writes the estimate into ``p.grad`` and lets Adam apply it.
- ``NormalisedPolicy``: OpenAI-ES's observation normaliser (sums kept as buffers, refit by
  the loop), with or without its clip of the std.
- ``TemperedPolicy``: a hybrid: the policy trained by backprop on a behaviour-cloning
  surrogate, its log-temperature (an extra forward argument) tuned by an ES outer loop.
- ``cma_step``: CMA-ES-style sampling through the Cholesky factor of a covariance adapted by
  a rank-mu update (active CMA's negative weights optional).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

OBS, ACT, T = 4, 2, 12


class Policy(nn.Module):
    """observation (position, goal offset) -> bounded force."""

    def __init__(self, hidden: int = 16):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(OBS, hidden), nn.Tanh(), nn.Linear(hidden, hidden),
                                  nn.Tanh())
        self.head = nn.Linear(hidden, ACT)

    def forward(self, obs):
        return torch.tanh(self.head(self.body(obs)))


def make_policy() -> Policy:
    torch.manual_seed(0)
    return Policy()


def episodes(g: torch.Generator, n: int = 8, missing: int | None = None):
    """Start positions and goals of ``n`` episodes; ``missing``: that episode's goal comes
    from a task table with a missing entry (NaN y)."""
    start, goal = torch.rand(n, 2, generator=g) * 2 - 1, torch.rand(n, 2, generator=g) * 2 - 1
    if missing is not None:
        goal[missing, 1] = float("nan")
    return start, goal


def rollout(policy, start, goal, drag: float = 0.1):
    """The return of each episode: a point mass pushed by the policy toward its goal, rewarded
    by minus its distance each step."""
    pos, vel, ret = start, torch.zeros_like(start), torch.zeros(start.shape[0])
    for _ in range(T):
        force = policy(torch.cat([pos, goal - pos], 1))
        vel = (1 - drag) * vel + 0.1 * force
        pos = pos + 0.1 * vel
        ret = ret - (pos - goal).norm(dim=1)
    return ret


def centred_ranks(f: torch.Tensor) -> torch.Tensor:
    """OpenAI-ES's fitness shaping: ranks scaled to [-0.5, 0.5]."""
    ranks = torch.empty_like(f)
    ranks[f.argsort()] = torch.arange(f.numel(), dtype=f.dtype)
    return ranks / (f.numel() - 1) - 0.5


def standardised(f: torch.Tensor, eps: float | None) -> torch.Tensor:
    if eps is None:
        return (f - f.mean()) / f.std()  # the bug: std is 0 when every perturbation scores alike
    return (f - f.mean()) / (f.std() + eps)


def es_gradient(policy, fitness_of, g: torch.Generator, pop: int = 8, sigma: float = 0.05,
                shaping: str = "std", eps: float | None = 1e-8):
    """OpenAI-ES's estimate of -d E[f] / d theta with antithetic noise, written into each
    parameter's ``.grad`` (descent on -fitness, as the optimizer expects). Returns the raw
    fitness of the perturbations."""
    params = list(policy.parameters())
    theta = parameters_to_vector(params).detach()
    half = torch.randn(pop // 2, theta.numel(), generator=g)
    noise = torch.cat([half, -half])
    with torch.no_grad():
        fitness = []
        for e in noise:
            vector_to_parameters(theta + sigma * e, params)
            fitness.append(fitness_of(policy))
        vector_to_parameters(theta, params)
    f = torch.stack(fitness)
    weights = centred_ranks(f) if shaping == "rank" else standardised(f, eps)
    grad = -(weights @ noise) / (pop * sigma)
    offset = 0
    for p in params:
        p.grad = grad[offset:offset + p.numel()].view_as(p).clone()
        offset += p.numel()
    return f


def success_rate(policy, start, goal, radius: float = 0.05):
    """A sparse reward: the fraction of episodes that end within ``radius`` of their goal
    (0 for every perturbation of a policy that never gets there)."""
    pos, vel = start, torch.zeros_like(start)
    for _ in range(T):
        vel = 0.9 * vel + 0.1 * policy(torch.cat([pos, goal - pos], 1))
        pos = pos + 0.1 * vel
    return ((pos - goal).norm(dim=1) < radius).float().mean()


class ObsNorm(nn.Module):
    """OpenAI-ES's observation normaliser: sums kept as buffers, refit by the loop each
    generation from the episodes' reset states; ``floor``: its clip of the std (1e-2) or
    none."""

    def __init__(self, dim: int, floor: float | None):
        super().__init__()
        self.register_buffer("total", torch.zeros(dim))
        self.register_buffer("sumsq", torch.zeros(dim))
        self.register_buffer("count", torch.tensor(1e-4))
        self.floor = floor

    @torch.no_grad()
    def refit(self, obs: torch.Tensor) -> None:
        self.total.copy_(obs.sum(0))
        self.sumsq.copy_(obs.pow(2).sum(0))
        self.count.fill_(obs.shape[0])

    def forward(self, obs):
        mean = self.total / self.count
        std = (self.sumsq / self.count - mean ** 2).clamp_min(0).sqrt()
        if self.floor is not None:
            std = std.clamp_min(self.floor)
        return (obs - mean) / std  # the bug (no floor): 0/0 in a feature every obs shares


class NormalisedPolicy(Policy):
    def __init__(self, floor: float | None = None, hidden: int = 16):
        super().__init__(hidden)
        self.obs_norm = ObsNorm(OBS, floor)

    def forward(self, obs):
        return super().forward(self.obs_norm(obs))


def make_normalised_policy() -> NormalisedPolicy:
    torch.manual_seed(0)
    return NormalisedPolicy()


def make_floored_policy() -> NormalisedPolicy:
    torch.manual_seed(0)
    return NormalisedPolicy(floor=1e-2)


def first_obs(start, goal) -> torch.Tensor:
    return torch.cat([start, goal - start], 1)


class TemperedPolicy(Policy):
    """A policy trained by backprop on a differentiable surrogate (behaviour cloning of an
    expert's bounded actions), whose log-temperature is a hyper-parameter an ES outer loop
    tunes: given to ``forward`` as a tensor, one value per episode."""

    def forward(self, obs, log_tau):
        tau = log_tau.exp()[:, None]  # the bug: underflows to 0 once log_tau drifts below -103
        return torch.tanh(self.head(self.body(obs)) / tau)


def make_tempered_policy() -> TemperedPolicy:
    torch.manual_seed(0)
    return TemperedPolicy()


def expert(start, goal) -> torch.Tensor:
    """The expert's action: full force toward the goal, saturated per axis."""
    return torch.sign(goal - start)


def outer_es(policy, log_tau: float, obs, target, g: torch.Generator, pop: int = 6,
             sigma: float = 0.5, lr: float = 100.0) -> float:
    """One OpenAI-ES step on the log-temperature: antithetic perturbations scored by the
    surrogate's loss under no_grad, standardised, a plain SGD step on the mean."""
    half = torch.randn(pop // 2, generator=g)
    noise = torch.cat([half, -half])
    with torch.no_grad():
        f = torch.stack([-(policy(obs, torch.full((obs.shape[0],), log_tau + sigma * float(e)))
                           - target).pow(2).mean() for e in noise])
    w = (f - f.mean()) / (f.std() + 1e-8)
    return log_tau + lr * float(w @ noise) / (pop * sigma)


def cma_step(policy, C, fitness_of, g: torch.Generator, pop: int = 8, sigma: float = 0.05,
             c_mu: float = 0.9, active: bool = True):
    """A CMA-ES-style generation on the flattened parameters: samples theta + sigma L z with
    L = cholesky(C), the mean moved by the rank-weighted steps (written into p.grad for Adam),
    C adapted by a rank-mu update; ``active``: the worst half's steps enter with negative
    weights (active CMA) without the bound that keeps C positive definite. Returns C."""
    params = list(policy.parameters())
    theta = parameters_to_vector(params).detach()
    L = torch.linalg.cholesky(C)  # fails once C has lost positive definiteness
    y = torch.randn(pop, theta.numel(), generator=g) @ L.T
    with torch.no_grad():
        f = []
        for yi in y:
            vector_to_parameters(theta + sigma * yi, params)
            f.append(fitness_of(policy))
        vector_to_parameters(theta, params)
    w = centred_ranks(torch.stack(f)) * 2  # in [-1, 1]: the worst half negative
    grad = -(w @ y) / pop
    offset = 0
    for p in params:
        p.grad = grad[offset:offset + p.numel()].view_as(p).clone()
        offset += p.numel()
    w_c = w if active else w.clamp_min(0)
    return (1 - c_mu) * C + c_mu * (y.T * w_c) @ y
