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
