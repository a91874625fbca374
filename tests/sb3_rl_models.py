"""Reinforcement learning with stable-baselines3 2.9 and gymnasium 1.4, as their users write it:
PPO and DQN on a CartPole-sized custom env, SAC on a Pendulum-sized one, each run by
``model.learn()`` with the recorder attached from an SB3 ``BaseCallback``. The envs go bad the
ways real ones do (a sensor's NaN reading, an all-zero observation, an unbounded reward); a
custom features extractor normalises its observation by its norm.

Factories rebuild the recorded network from the spaces alone (``make_*``), as the replay
needs: the PPO policy, DQN's online Q-network, SAC's twin critic."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import torch
from gymnasium import spaces
from stable_baselines3 import DQN, PPO, SAC
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.torch_layers import BaseFeaturesExtractor
from torch import nn

from recorder import FlightRecorder
from recorder.sb3 import through_forward

OBS = 4
GUARDED_METHODS = ("collect_rollouts", "train")  # what recorder.sb3 wraps while learning
EP_LEN = 16


class ProbeEnv(gym.Env):
    """A CartPole-sized env (4 observations, 2 actions; ``continuous``: one action in [-2, 2]
    as Pendulum's torque). Observations are seeded normal draws; the episode ends after
    EP_LEN steps. Faults, counted in env steps since the env was built:

    ``nan_at``: the observation of that step holds a NaN (a sensor dropped out).
    ``zero_at``: the observation of every ``zero_at``-th step is all zeros (a sensor that
    drops out and reads 0).
    ``reward_growth``: the reward is ``reward_growth ** t`` of the step in the episode, not
    bounded (a distance-based reward of an object that flew off), float32 ``inf`` once past
    3.4e38.
    ``constant``: observation column 0 is always 1.0 (a feature that never varies)."""

    metadata: dict = {"render_modes": []}

    def __init__(self, continuous: bool = False, nan_at: int | None = None,
                 zero_at: int | None = None, reward_growth: float | None = None,
                 constant: bool = False, seed: int = 0):
        super().__init__()
        self.observation_space = spaces.Box(-np.inf, np.inf, (OBS,), np.float32)
        self.action_space = spaces.Box(-2.0, 2.0, (1,), np.float32) if continuous \
            else spaces.Discrete(2)
        self.nan_at, self.zero_at, self.growth = nan_at, zero_at, reward_growth
        self.constant, self.rng = constant, np.random.default_rng(seed)
        self.n, self.t = 0, 0

    def _obs(self) -> np.ndarray:
        o = self.rng.standard_normal(OBS).astype(np.float32)
        if self.constant:
            o[0] = 1.0
        if self.n == self.nan_at:
            o[2] = np.nan  # the sensor's reading
        if self.zero_at is not None and self.n % self.zero_at == 0 and self.n:
            o[:] = 0.0
        return o

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        self.n += 1
        self.t += 1
        reward = 1.0 if self.growth is None else float(self.growth) ** self.t
        return self._obs(), np.float32(reward), False, self.t >= EP_LEN, {}


class UnitNorm(BaseFeaturesExtractor):
    """A custom features extractor that puts every observation on the unit sphere, then a
    layer: ``x / ||x||``, no eps (an all-zero observation is 0/0)."""

    def __init__(self, observation_space: spaces.Box, features_dim: int = 8):
        super().__init__(observation_space, features_dim)
        self.fc = nn.Linear(observation_space.shape[0], features_dim)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        x = obs / obs.norm(dim=-1, keepdim=True)  # the bug: no eps
        return torch.relu(self.fc(x))


class RootNorm(BaseFeaturesExtractor):
    """A gain by the observation's energy, ``1 + sqrt(mean(h^2))`` of a bias-free projection
    ``h``: finite forward at an all-zero observation (sqrt(0) = 0), but sqrt's derivative at 0
    is infinite and ``h``'s is 0: 0 * inf, a NaN made only in the backward."""

    def __init__(self, observation_space: spaces.Box, features_dim: int = 8):
        super().__init__(observation_space, features_dim)
        self.proj = nn.Linear(observation_space.shape[0], 4, bias=False)
        self.fc = nn.Linear(observation_space.shape[0], features_dim)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        h = self.proj(obs)
        gain = 1 + torch.sqrt((h * h).mean(-1, keepdim=True))  # the bug: sqrt at 0
        return torch.relu(self.fc(obs) * gain)


class RecordPolicy(BaseCallback):
    """Attaches a FlightRecorder when training starts, detaches when it ends. ``part``: the
    attribute of the SB3 model to record (``"policy"``; DQN's ``"q_net"``; SAC's
    ``"critic"``), ``optim``: the attribute path of its optimizer on the model."""

    def __init__(self, out_dir, factory: str, part: str = "policy",
                 optim: str = "policy.optimizer", **kwargs):
        super().__init__()
        self.out_dir, self.factory, self.part, self.optim = out_dir, factory, part, optim
        self.kwargs = kwargs
        self.rec: FlightRecorder | None = None

    def _on_training_start(self) -> None:
        net = getattr(self.model, self.part)
        opt = self.model
        for name in self.optim.split("."):
            opt = getattr(opt, name)
        self.rec = FlightRecorder(net, opt, out_dir=self.out_dir, factory=self.factory,
                                  **self.kwargs).attach()

    def _on_step(self) -> bool:
        return True

    def _on_training_end(self) -> None:
        if self.rec is not None:
            self.rec.detach()


NET = {"net_arch": [16]}


def ppo(env: gym.Env | None = None, lr: float = 3e-4, extractor=None, seed: int = 0) -> PPO:
    kw = dict(NET)
    if extractor is not None:
        kw.update(features_extractor_class=extractor)
    return PPO("MlpPolicy", env or ProbeEnv(), n_steps=32, batch_size=16, n_epochs=1,
               learning_rate=lr, policy_kwargs=kw, device="cpu", seed=seed)


def dqn(env: gym.Env | None = None, lr: float = 1e-3, extractor=None, seed: int = 0) -> DQN:
    kw = dict(NET)
    if extractor is not None:
        kw.update(features_extractor_class=extractor)
    return DQN("MlpPolicy", env or ProbeEnv(), learning_rate=lr, buffer_size=256,
               learning_starts=16, batch_size=16, train_freq=4, gradient_steps=1,
               target_update_interval=32, policy_kwargs=kw, device="cpu", seed=seed)


def sac(env: gym.Env | None = None, lr: float = 3e-4, seed: int = 0, **kw) -> SAC:
    return SAC("MlpPolicy", env or ProbeEnv(continuous=True), learning_rate=lr,
               buffer_size=256, learning_starts=16, batch_size=16, train_freq=4,
               gradient_steps=1, policy_kwargs=dict(NET), device="cpu", seed=seed, **kw)


def make_ppo_policy():
    return through_forward(ppo().policy)


def make_ppo_unit_norm():
    return through_forward(ppo(extractor=UnitNorm).policy)


def make_dqn_q_net():
    return dqn().q_net


def make_dqn_root_norm():
    return dqn(extractor=RootNorm).q_net


def make_sac_critic():
    return sac().critic


def make_ppo_cont():
    return through_forward(ppo(ProbeEnv(continuous=True)).policy)


def make_sac_actor():
    return sac().actor


def make_ppo_root_norm():
    return through_forward(ppo(extractor=RootNorm).policy)


def make_ppo_cont_plain():
    """The policy as a factory for a plain policy builds it: without through_forward."""
    return ppo(ProbeEnv(continuous=True)).policy
