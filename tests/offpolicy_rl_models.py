"""Off-policy deep RL as CleanRL writes it: SAC's tanh-squashed Gaussian actor and twin soft Q
critics with Polyak-averaged targets and a learnable ``log_alpha``, all held by one agent
module; C51's categorical Q network with the projection of the Bellman target onto its atoms;
a replay buffer of numpy arrays and prioritized replay's importance weights."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

OBS, ACT = 6, 2
LOG_STD_MAX, LOG_STD_MIN = 2, -5


class SoftQNetwork(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(OBS + ACT, 32)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 1)

    def forward(self, x, a):
        x = torch.cat([x, a], 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


class Actor(nn.Module):
    """CleanRL's SAC actor: ``forward`` gives mean and log_std, ``get_action`` samples the
    squashed action and its log-probability with the change-of-variables correction."""

    def __init__(self, eps: float = 1e-6):
        super().__init__()
        self.fc1 = nn.Linear(OBS, 32)
        self.fc2 = nn.Linear(32, 32)
        self.fc_mean = nn.Linear(32, ACT)
        self.fc_logstd = nn.Linear(32, ACT)
        self.register_buffer("action_scale", torch.ones(ACT))
        self.register_buffer("action_bias", torch.zeros(ACT))
        self.eps = eps

    def forward(self, x):
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        mean = self.fc_mean(x)
        log_std = torch.tanh(self.fc_logstd(x))
        log_std = LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (log_std + 1)
        return mean, log_std

    def get_action(self, x):
        mean, log_std = self(x)
        std = log_std.exp()
        normal = torch.distributions.Normal(mean, std)
        x_t = normal.rsample()
        y_t = torch.tanh(x_t)
        action = y_t * self.action_scale + self.action_bias
        log_prob = normal.log_prob(x_t)
        log_prob -= torch.log(self.action_scale * (1 - y_t.pow(2)) + self.eps)  # squash corr.
        log_prob = log_prob.sum(1, keepdim=True)
        mean = torch.tanh(mean) * self.action_scale + self.action_bias
        return action, log_prob, mean


class SquashedActor(Actor):
    """The actor whose forward samples (SpinningUp's ``SquashedGaussianMLPActor``, pranz24's
    ``sample``): the action and its log-probability, squash correction included."""

    def get_action(self, x):
        return self(x)

    def forward(self, x):
        h = F.relu(self.fc2(F.relu(self.fc1(x))))
        mean = self.fc_mean(h)
        log_std = self.fc_logstd(h).clamp(LOG_STD_MIN, LOG_STD_MAX)
        normal = torch.distributions.Normal(mean, log_std.exp())
        x_t = normal.rsample()
        y_t = torch.tanh(x_t)
        correction = torch.log(self.action_scale * (1 - y_t.pow(2)) + self.eps)
        log_prob = normal.log_prob(x_t) - correction
        return y_t, log_prob.sum(1, keepdim=True), torch.tanh(mean)


def make_squashed_actor_no_eps() -> SquashedActor:
    torch.manual_seed(4)
    return SquashedActor(eps=0.0)


class TwinCritic(nn.Module):
    """SB3's ``ContinuousCritic``: both Q networks in one forward, which returns both."""

    def __init__(self):
        super().__init__()
        self.q_networks = nn.ModuleList([SoftQNetwork(), SoftQNetwork()])

    def forward(self, obs, actions):
        return tuple(q(obs, actions) for q in self.q_networks)


def make_critic() -> TwinCritic:
    torch.manual_seed(3)
    return TwinCritic()


def make_actor() -> Actor:
    torch.manual_seed(4)
    return Actor()


def make_actor_no_eps() -> Actor:
    torch.manual_seed(4)
    return Actor(eps=0.0)


class DeterministicActor(nn.Module):
    """CleanRL's TD3 actor: a tanh-bounded action, rescaled to the action space."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(OBS, 32)
        self.fc2 = nn.Linear(32, 32)
        self.fc_mu = nn.Linear(32, ACT)
        self.register_buffer("action_scale", torch.ones(ACT))
        self.register_buffer("action_bias", torch.zeros(ACT))

    def forward(self, x):
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return torch.tanh(self.fc_mu(x)) * self.action_scale + self.action_bias


def make_td3_actor() -> DeterministicActor:
    torch.manual_seed(5)
    return DeterministicActor()


class SAC(nn.Module):
    """Every network of the agent in one module (the recorder watches one model)."""

    def __init__(self, eps: float = 1e-6):
        super().__init__()
        self.actor = Actor(eps)
        self.qf1 = SoftQNetwork()
        self.qf2 = SoftQNetwork()
        self.qf1_target = SoftQNetwork()
        self.qf2_target = SoftQNetwork()
        self.qf1_target.load_state_dict(self.qf1.state_dict())
        self.qf2_target.load_state_dict(self.qf2.state_dict())
        for p in [*self.qf1_target.parameters(), *self.qf2_target.parameters()]:
            p.requires_grad_(False)
        self.log_alpha = nn.Parameter(torch.zeros(1))


def make_sac() -> SAC:
    torch.manual_seed(1)
    return SAC()


def make_sac_no_eps() -> SAC:
    torch.manual_seed(1)
    return SAC(eps=0.0)


class ReplayBuffer:
    """SB3's buffer: preallocated numpy arrays, a sampled batch turned into tensors."""

    def __init__(self, size: int, seed: int = 0):
        self.obs = np.zeros((size, OBS), dtype=np.float32)
        self.next_obs = np.zeros((size, OBS), dtype=np.float32)
        self.actions = np.zeros((size, ACT), dtype=np.float32)
        self.rewards = np.zeros((size, 1), dtype=np.float32)
        self.dones = np.zeros((size, 1), dtype=np.float32)
        self.pos, self.full, self.size = 0, False, size
        self.rng = np.random.default_rng(seed)

    def add(self, obs, next_obs, action, reward, done):
        self.obs[self.pos] = obs
        self.next_obs[self.pos] = next_obs
        self.actions[self.pos] = action
        self.rewards[self.pos] = reward
        self.dones[self.pos] = done
        self.pos = (self.pos + 1) % self.size
        self.full = self.full or self.pos == 0

    def sample(self, n: int):
        idx = self.rng.integers(0, self.size if self.full else self.pos, size=n)
        return self.take(idx)

    def take(self, idx):
        return tuple(torch.as_tensor(a[idx]) for a in
                     (self.obs, self.actions, self.next_obs, self.rewards, self.dones))


def soft_update(net: nn.Module, target: nn.Module, tau: float) -> None:
    """The Polyak average, in place under no_grad (SB3's ``polyak_update``)."""
    with torch.no_grad():
        for p, p_targ in zip(net.parameters(), target.parameters()):
            p_targ.data.mul_(1 - tau).add_(tau * p.data)


def soft_update_foreach(net: nn.Module, target: nn.Module, tau: float) -> None:
    with torch.no_grad():
        torch._foreach_lerp_(list(target.parameters()), list(net.parameters()), tau)


class C51Network(nn.Module):
    """CleanRL's C51 Q network: one softmax over atoms per action."""

    def __init__(self, n_actions: int = 3, n_atoms: int = 101, v_min: float = -100.0,
                 v_max: float = 100.0):
        super().__init__()
        self.n, self.n_atoms, self.v_min, self.v_max = n_actions, n_atoms, v_min, v_max
        self.register_buffer("atoms", torch.linspace(v_min, v_max, steps=n_atoms))
        self.network = nn.Sequential(nn.Linear(OBS, 32), nn.ReLU(), nn.Linear(32, 32),
                                     nn.ReLU(), nn.Linear(32, n_actions * n_atoms))

    def forward(self, x, action=None):
        logits = self.network(x)
        pmfs = torch.softmax(logits.view(len(x), self.n, self.n_atoms), dim=2)
        q_values = (pmfs * self.atoms).sum(2)
        if action is None:
            action = torch.argmax(q_values, 1)
        return action, pmfs[torch.arange(len(x)), action]


def make_c51() -> C51Network:
    torch.manual_seed(2)
    return C51Network()


def project_c51(next_pmfs, rewards, dones, atoms, gamma: float, keep_tied: bool = True):
    """The categorical projection of ``r + gamma * z`` onto the fixed atoms. Without the
    ``(l == u)`` term, a target landing exactly on an atom puts its mass on neither side."""
    v_min, v_max = atoms[0].item(), atoms[-1].item()
    delta_z = atoms[1] - atoms[0]
    next_atoms = rewards + gamma * atoms * (1 - dones)
    tz = next_atoms.clamp(v_min, v_max)
    b = (tz - v_min) / delta_z
    lo = b.floor().clamp(0, len(atoms) - 1)
    up = b.ceil().clamp(0, len(atoms) - 1)
    tied = (lo == up).float() if keep_tied else 0.0
    d_m_l = (up + tied - b) * next_pmfs
    d_m_u = (b - lo) * next_pmfs
    target_pmfs = torch.zeros_like(next_pmfs)
    for i in range(target_pmfs.size(0)):
        target_pmfs[i].index_add_(0, lo[i].long(), d_m_l[i])
        target_pmfs[i].index_add_(0, up[i].long(), d_m_u[i])
    return target_pmfs


def c51_loss(old_pmfs, target_pmfs):
    """The cross-entropy of the projected target, renormalised against float drift."""
    target_pmfs = target_pmfs / target_pmfs.sum(-1, keepdim=True)
    return (-(target_pmfs * old_pmfs.clamp(min=1e-5, max=1 - 1e-5).log()).sum(-1)).mean()


def per_weights(priorities: np.ndarray, idx: np.ndarray, beta: float) -> torch.Tensor:
    """Prioritized replay's importance weights ``(N * P(i))^-beta / max w``."""
    probs = priorities / priorities.sum()
    weights = (len(priorities) * probs[idx]) ** (-beta)
    return torch.as_tensor(weights / weights.max(), dtype=torch.float32)


def twin_q_loss(qs, next_q_value):
    """The critics' TD loss over both Q networks (CleanRL's ``qf1_loss + qf2_loss``)."""
    q1, q2 = qs
    return F.mse_loss(q1.view(-1), next_q_value) + F.mse_loss(q2.view(-1), next_q_value)


class QRNetwork(nn.Module):
    """SB3-contrib's QR-DQN network: ``n_quantiles`` values per action."""

    def __init__(self, n_actions: int = 3, n_quantiles: int = 16):
        super().__init__()
        self.n, self.n_quantiles = n_actions, n_quantiles
        self.net = nn.Sequential(nn.Linear(OBS, 32), nn.ReLU(),
                                 nn.Linear(32, n_actions * n_quantiles))

    def forward(self, x):
        return self.net(x).view(-1, self.n_quantiles, self.n)


def make_qr() -> QRNetwork:
    torch.manual_seed(6)
    return QRNetwork()


def quantile_huber_loss(current_quantiles, target_quantiles, weights):
    """SB3-contrib's pairwise quantile Huber loss (kappa 1), per sample, importance-weighted."""
    n = current_quantiles.shape[-1]
    cum_prob = (torch.arange(n, dtype=torch.float32) + 0.5) / n
    pairwise_delta = target_quantiles.unsqueeze(-2) - current_quantiles.unsqueeze(-1)
    abs_delta = torch.abs(pairwise_delta)
    huber = torch.where(abs_delta > 1, abs_delta - 0.5, pairwise_delta ** 2 * 0.5)
    loss = torch.abs(cum_prob.view(1, -1, 1) - (pairwise_delta.detach() < 0).float()) * huber
    per_sample = loss.sum(dim=-2).mean(dim=-1)
    return (weights * per_sample).mean()


class DQNPolicy(nn.Module):
    """SB3's ``DQNPolicy``: the online Q network and its target in one module; ``forward`` is
    the online network's, the loop calls ``q_net_target`` itself."""

    def __init__(self, n_actions: int = 3):
        super().__init__()
        self.q_net = nn.Sequential(nn.Linear(OBS, 32), nn.ReLU(), nn.Linear(32, n_actions))
        self.q_net_target = nn.Sequential(nn.Linear(OBS, 32), nn.ReLU(),
                                          nn.Linear(32, n_actions))
        self.q_net_target.load_state_dict(self.q_net.state_dict())
        self.q_net_target.requires_grad_(False)

    def forward(self, x):
        return self.q_net(x)


def make_dqn_policy() -> DQNPolicy:
    torch.manual_seed(7)
    return DQNPolicy()
