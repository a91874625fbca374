"""An actor-critic as reinforcement-learning code writes it (CleanRL's PPO agent): two heads
on one model, rollouts under ``no_grad`` in train mode, the PPO loss computed in the loop."""

from __future__ import annotations

import torch
from torch import nn

OBS, ACT = 8, 4


class Agent(nn.Module):
    def __init__(self):
        super().__init__()
        self.critic = nn.Sequential(nn.Linear(OBS, 32), nn.Tanh(), nn.Linear(32, 1))
        self.actor = nn.Sequential(nn.Linear(OBS, 32), nn.Tanh(), nn.Linear(32, ACT))

    def forward(self, x):
        return self.actor(x), self.critic(x)


def make_agent() -> Agent:
    torch.manual_seed(0)
    return Agent()


class Critic(nn.Module):
    """A value network whose width is an argument with a default the run does not use."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(OBS, width), nn.Tanh(), nn.Linear(width, 1))

    def forward(self, x):
        return self.net(x)


class DropoutPolicy(nn.Module):
    """pytorch/examples' REINFORCE policy: dropout in the hidden layer, action probabilities
    out (one observation per forward, an action sampled between forwards)."""

    def __init__(self):
        super().__init__()
        self.affine1 = nn.Linear(OBS, 32)
        self.dropout = nn.Dropout(p=0.6)
        self.affine2 = nn.Linear(32, ACT)

    def forward(self, x):
        return torch.softmax(self.affine2(torch.relu(self.dropout(self.affine1(x)))), dim=1)


def make_dropout_policy() -> DropoutPolicy:
    torch.manual_seed(543)
    return DropoutPolicy()


class QNet(nn.Module):
    """The PyTorch DQN tutorial's network: observations in, one value per action out."""

    def __init__(self):
        super().__init__()
        self.layer1 = nn.Linear(OBS, 32)
        self.layer2 = nn.Linear(32, 32)
        self.layer3 = nn.Linear(32, ACT)

    def forward(self, x):
        return self.layer3(torch.relu(self.layer2(torch.relu(self.layer1(x)))))


def make_qnet() -> QNet:
    torch.manual_seed(0)
    return QNet()


class RecurrentPolicy(nn.Module):
    """A recurrent A2C policy (ikostrikov's pytorch-a2c-ppo-acktr style): a GRUCell stepped once
    per environment step, its state carried between forwards and reset where an episode ended."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(OBS, 16)
        self.gru = nn.GRUCell(16, 16)
        self.pi = nn.Linear(16, ACT)
        self.v = nn.Linear(16, 1)

    def forward(self, obs, h, masks):
        h = self.gru(torch.relu(self.enc(obs)), h * masks)
        return self.pi(h), self.v(h).squeeze(-1), h


def make_recurrent_policy() -> RecurrentPolicy:
    torch.manual_seed(7)
    return RecurrentPolicy()


def a2c_loss(logits, values, actions, returns):
    """The rollout's policy-gradient and value loss with an entropy bonus."""
    logp = torch.log_softmax(logits, -1)
    adv = returns - values
    pg = -(logp.gather(-1, actions[..., None]).squeeze(-1) * adv.detach()).mean()
    return pg + 0.5 * adv.pow(2).mean() + 0.01 * (logp.exp() * logp).sum(-1).mean()


class SquashedGaussianActor(nn.Module):
    """A SAC actor (CleanRL's): a mean and a bounded log-std head over a shared body."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(OBS, 32), nn.ReLU())
        self.mean, self.log_std = nn.Linear(32, 2), nn.Linear(32, 2)

    def forward(self, x):
        h = self.body(x)
        return self.mean(h), -5 + 3.5 * (torch.tanh(self.log_std(h)) + 1)


def make_squashed_actor() -> SquashedGaussianActor:
    torch.manual_seed(0)
    return SquashedGaussianActor()


class SquashedActorLoss(nn.Module):
    """alpha * log pi(a|s) - Q(s, a) for a tanh-squashed Gaussian action, its log-probability
    corrected by log(1 - tanh(u)²) without the usual eps, against a fixed critic."""

    def forward(self, out, noise):
        mean, log_std = out
        u = mean + log_std.exp() * noise
        a = torch.tanh(u)
        normal = torch.distributions.Normal(mean, log_std.exp())
        log_pi = (normal.log_prob(u) - torch.log(1 - a.pow(2))).sum(1)
        return (0.2 * log_pi + ((a - 0.9) ** 2).sum(1)).mean()


class GaussianPolicy(nn.Module):
    """A continuous actor-critic (CleanRL's continuous PPO agent): a state-independent
    ``log_std`` parameter beside the mean and value heads."""

    def __init__(self):
        super().__init__()
        self.mu = nn.Sequential(nn.Linear(OBS, 32), nn.Tanh(), nn.Linear(32, 2))
        self.v = nn.Linear(OBS, 1)
        self.log_std = nn.Parameter(torch.zeros(2))

    def forward(self, x):
        return self.mu(x), self.log_std.expand(x.shape[0], 2), self.v(x).squeeze(-1)


def make_gaussian_policy() -> GaussianPolicy:
    torch.manual_seed(2)
    return GaussianPolicy()


def gaussian_a2c_loss(out, action, ret):
    """Policy gradient, value loss, and the entropy bonus with its sign flipped (the bug: it
    rewards a narrower policy, so ``log_std`` drifts down every update)."""
    mu, log_std, v = out
    dist = torch.distributions.Normal(mu, log_std.exp(), validate_args=False)
    pg = -(dist.log_prob(action).sum(-1) * (ret - v).detach()).mean()
    return pg + 0.5 * (ret - v).pow(2).mean() + dist.entropy().sum(-1).mean()


class GaussianActor(nn.Module):
    """A continuous-action policy as CleanRL's continuous PPO writes it: the mean from a
    network, a state-independent learned log standard deviation expanded to the batch."""

    def __init__(self):
        super().__init__()
        self.mean = nn.Sequential(nn.Linear(OBS, 32), nn.Tanh(), nn.Linear(32, ACT))
        self.log_std = nn.Parameter(torch.zeros(1, ACT))

    def forward(self, x):
        mean = self.mean(x)
        return mean, self.log_std.expand_as(mean)


def make_gaussian_actor() -> GaussianActor:
    torch.manual_seed(0)
    return GaussianActor()
