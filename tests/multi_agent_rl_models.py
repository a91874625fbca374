"""Cooperative multi-agent RL as PyMARL, EPyMARL and MAPPO write it: one GRU agent network
shared by every agent (its input the observation, the last action's one-hot and the agent id's
one-hot), QMIX's monotonic mixer whose hypernetworks' weights go through ``abs``, TD(lambda)
targets over padded episodes with a ``filled`` mask and ``terminated`` flags, and MAPPO's
recurrent actor (illegal actions' logits filled before ``Categorical``) beside a centralised
critic whose returns a running mean/std ``ValueNorm`` normalises. Episodes come from a toy
environment in which agents die: a dead agent has only the no-op available (SMAC's rule)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import Categorical
from torch.utils.data import Dataset

N_AGENTS, N_ACTIONS, OBS, STATE, T, HID = 3, 5, 6, 8, 7, 16


# ----------------------------------------------------------------------------- QMIX (PyMARL)
class RNNAgent(nn.Module):
    """PyMARL's ``rnn_agent``: fc1, relu, GRUCell, fc2; one network for every agent."""

    def __init__(self, input_shape: int):
        super().__init__()
        self.fc1 = nn.Linear(input_shape, HID)
        self.rnn = nn.GRUCell(HID, HID)
        self.fc2 = nn.Linear(HID, N_ACTIONS)

    def forward(self, inputs, hidden_state):
        x = F.relu(self.fc1(inputs))
        h = self.rnn(x, hidden_state.reshape(-1, HID))
        return self.fc2(h), h


class QMixer(nn.Module):
    """PyMARL's ``QMixer``: hypernetworks of the state make the mixing weights, kept >= 0 by
    ``abs`` (monotonic in every agent's Q), a state-dependent bias and V(s)."""

    def __init__(self, embed: int = 8):
        super().__init__()
        self.embed = embed
        self.hyper_w_1 = nn.Linear(STATE, embed * N_AGENTS)
        self.hyper_w_final = nn.Linear(STATE, embed)
        self.hyper_b_1 = nn.Linear(STATE, embed)
        self.V = nn.Sequential(nn.Linear(STATE, embed), nn.ReLU(), nn.Linear(embed, 1))

    def forward(self, agent_qs, states):
        bs = agent_qs.size(0)
        states = states.reshape(-1, STATE)
        agent_qs = agent_qs.view(-1, 1, N_AGENTS)
        w1 = torch.abs(self.hyper_w_1(states)).view(-1, N_AGENTS, self.embed)
        b1 = self.hyper_b_1(states).view(-1, 1, self.embed)
        hidden = F.elu(torch.bmm(agent_qs, w1) + b1)
        w_final = torch.abs(self.hyper_w_final(states)).view(-1, self.embed, 1)
        v = self.V(states).view(-1, 1, 1)
        y = torch.bmm(hidden, w_final) + v
        return y.view(bs, -1, 1)


def agent_inputs(obs, last_actions):
    """PyMARL's ``_build_inputs``: observation, last action one-hot, agent id one-hot."""
    b, t = obs.shape[:2]
    ids = torch.eye(N_AGENTS).expand(b, t, N_AGENTS, N_AGENTS)
    return torch.cat([obs, last_actions, ids], dim=-1)


class QMIX(nn.Module):
    """The learner's networks as one module: the agents' Qs unrolled over the episode, the
    chosen actions' Qs mixed by the state, and every agent's Qs (the learner detaches them to
    pick the target's actions). ``agent_qs`` alone serves the target network."""

    def __init__(self):
        super().__init__()
        self.agent = RNNAgent(OBS + N_ACTIONS + N_AGENTS)
        self.mixer = QMixer()

    def agent_qs(self, obs, last_actions):
        b, t = obs.shape[:2]
        inputs = agent_inputs(obs, last_actions)
        h = obs.new_zeros(b * N_AGENTS, HID)
        out = []
        for i in range(t):
            q, h = self.agent(inputs[:, i].reshape(b * N_AGENTS, -1), h)
            out.append(q.view(b, N_AGENTS, -1))
        return torch.stack(out, dim=1)  # (B, T, N, A)

    def forward(self, obs, last_actions, state, actions):
        qs = self.agent_qs(obs, last_actions)
        chosen = torch.gather(qs[:, :-1], dim=3, index=actions.unsqueeze(3)).squeeze(3)
        return self.mixer(chosen, state[:, :-1]), qs


def make_qmix():
    torch.manual_seed(0)
    return QMIX()


def build_td_lambda_targets(rewards, terminated, mask, target_qs, gamma=0.99, td_lambda=0.8):
    """PyMARL's ``build_td_lambda_targets``: ``target_qs`` over all T, the rest over T-1."""
    ret = target_qs.new_zeros(*target_qs.shape)
    ret[:, -1] = target_qs[:, -1] * (1 - torch.sum(terminated, dim=1))
    for t in range(ret.shape[1] - 2, -1, -1):
        ret[:, t] = td_lambda * gamma * ret[:, t + 1] + mask[:, t] * (
            rewards[:, t] + (1 - td_lambda) * gamma * target_qs[:, t + 1] * (1 - terminated[:, t]))
    return ret[:, 0:-1]


def qmix_targets(online_qs, target, batch, gamma=0.99, td_lambda=0.8):
    """Double Q: the online agents (their Qs detached) pick the best available action, the
    target agents and mixer value it (under no_grad, by the loop)."""
    online = online_qs.clone()
    online[batch["avail"] == 0] = -9999999
    best = online.max(dim=3, keepdim=True)[1]
    tq = target.agent_qs(batch["obs"], batch["last_actions"])
    tq = torch.gather(tq, 3, best).squeeze(3)
    tq = target.mixer(tq, batch["state"])
    return build_td_lambda_targets(batch["reward"], batch["terminated"], batch["filled"],
                                   tq, gamma, td_lambda)


def masked_td_loss(q_tot, targets, mask):
    """PyMARL's QLearner loss: squared TD error over the filled steps only."""
    td_error = q_tot - targets.detach()
    masked_td_error = td_error * mask
    return (masked_td_error ** 2).sum() / mask.sum()


# ----------------------------------------------------------------------------- episodes
def epsilon_greedy(q, avail, epsilon, gen):
    """PyMARL's ``EpsilonGreedyActionSelector``: a random available action with probability
    epsilon, else the best available one."""
    masked = q.clone()
    masked[avail == 0] = -float("inf")
    random_actions = torch.multinomial(avail.float().reshape(-1, N_ACTIONS), 1,
                                       generator=gen).view(avail.shape[:-1])
    pick = (torch.rand(avail.shape[:-1], generator=gen) < epsilon).long()
    return pick * random_actions + (1 - pick) * masked.max(dim=-1)[1]


def make_episode(seed: int, length: int | None = None, dead_only_noop: bool = True):
    """One padded episode of the toy environment: agents die at random steps (after which only
    the no-op, action 0, is available), the episode ends when all are dead or at ``length``."""
    gen = torch.Generator().manual_seed(seed)
    length = length or int(torch.randint(3, T, (1,), generator=gen))
    obs = torch.zeros(T, N_AGENTS, OBS)
    state = torch.zeros(T, STATE)
    avail = torch.zeros(T, N_AGENTS, N_ACTIONS)
    actions = torch.zeros(T, N_AGENTS, dtype=torch.long)
    reward = torch.zeros(T - 1, 1)
    death = torch.randint(1, T + 3, (N_AGENTS,), generator=gen)
    for t in range(length):
        alive = (death > t).float()
        obs[t] = torch.randn(N_AGENTS, OBS, generator=gen) * alive[:, None]
        state[t] = torch.randn(STATE, generator=gen)
        avail[t] = alive[:, None].expand(N_AGENTS, N_ACTIONS)
        if dead_only_noop:
            avail[t, :, 0] = 1.0  # SMAC: a dead agent's only action is the no-op
        q = torch.randn(N_AGENTS, N_ACTIONS, generator=gen)
        some = avail[t].sum(-1) > 0  # (an agent with no available action takes 0)
        picked = epsilon_greedy(q, avail[t].clamp_min(1 - some[:, None].float()), 0.5, gen)
        actions[t] = picked * some
        if t < T - 1:
            reward[t] = float(torch.rand(1, generator=gen)) * alive.mean()
    last = torch.zeros(T, N_AGENTS, N_ACTIONS)
    last[1:] = F.one_hot(actions[:-1], N_ACTIONS).float()
    last[length:] = 0
    terminated = torch.zeros(T - 1, 1)
    filled = torch.zeros(T - 1, 1)
    filled[:length - 1] = 1
    if length < T:
        terminated[length - 2] = 1
    return {"obs": obs, "state": state, "avail": avail, "actions": actions[:-1],
            "last_actions": last, "reward": reward, "terminated": terminated, "filled": filled}


class EpisodeBuffer(Dataset):
    """An episode replay buffer as a map-style dataset (the DataLoader batches episodes)."""

    def __init__(self, n: int = 16, seed: int = 0, dead_only_noop: bool = True):
        self.episodes = [make_episode(seed + i, dead_only_noop=dead_only_noop) for i in range(n)]

    def __len__(self):
        return len(self.episodes)

    def __getitem__(self, i):
        return self.episodes[i]


# ----------------------------------------------------------------------------- MAPPO
class ACTLayer(nn.Module):
    """MAPPO's ``ACTLayer`` with a ``Categorical`` head: unavailable actions' logits set to
    ``fill`` (MAPPO's -1e10) before the distribution is built."""

    def __init__(self, fill: float = -1e10):
        super().__init__()
        self.linear = nn.Linear(HID, N_ACTIONS)
        self.fill = fill

    def forward(self, x, available_actions):
        logits = self.linear(x)
        logits = logits.masked_fill(available_actions == 0, self.fill)
        return Categorical(logits=logits)


class RActor(nn.Module):
    """MAPPO's ``R_Actor``: an MLP base over observation and agent id, a GRU over the episode,
    the action layer; returns the taken actions' log-probabilities, the probabilities and
    the entropy, per agent and step."""

    def __init__(self, fill: float = -1e10, joint: bool = False):
        super().__init__()
        self.joint = joint
        self.base = nn.Sequential(nn.Linear(OBS + N_AGENTS, HID), nn.ReLU(), nn.LayerNorm(HID))
        self.rnn = nn.GRU(HID, HID, batch_first=True)
        self.act = ACTLayer(fill)

    def forward(self, obs, available_actions, actions):
        b, t = obs.shape[:2]
        ids = torch.eye(N_AGENTS).expand(b, t, N_AGENTS, N_AGENTS)
        x = self.base(torch.cat([obs, ids], -1))
        x = x.transpose(1, 2).reshape(b * N_AGENTS, t, HID)  # one sequence per agent
        x, _ = self.rnn(x)
        x = x.reshape(b, N_AGENTS, t, HID).transpose(1, 2)
        dist = self.act(x, available_actions)
        if self.joint:  # one log-probability of the joint action, shared by the agents
            logp = joint_action_logp(dist.probs, actions)[..., None].expand(-1, -1, N_AGENTS)
            return logp, dist.probs, dist.entropy()
        return dist.log_prob(actions), dist.probs, dist.entropy()


class RCritic(nn.Module):
    """MAPPO's centralised ``R_Critic``: V of the global state, for every agent."""

    def __init__(self):
        super().__init__()
        self.base = nn.Sequential(nn.Linear(STATE, HID), nn.ReLU(), nn.LayerNorm(HID))
        self.v_out = nn.Linear(HID, 1)

    def forward(self, state):
        return self.v_out(self.base(state))


class MAPPOPolicy(nn.Module):
    def __init__(self, fill: float = -1e10, joint: bool = False):
        super().__init__()
        self.actor = RActor(fill, joint)
        self.critic = RCritic()

    def forward(self, obs, state, available_actions, actions):
        logp, probs, entropy = self.actor(obs, available_actions, actions)
        return logp, probs, entropy, self.critic(state).expand(-1, -1, N_AGENTS)


def make_mappo():
    torch.manual_seed(0)
    return MAPPOPolicy()


def make_mappo_joint(prefer_noop: float = 40.0):
    """The joint-ratio variant, its policy converged to the no-op (its logit ``prefer_noop``
    above the others: the explored actions' probabilities are about exp(-40) each)."""
    torch.manual_seed(0)
    policy = MAPPOPolicy(joint=True)
    with torch.no_grad():
        policy.actor.act.linear.bias[0] += prefer_noop
    return policy


def make_mappo_inf_mask():
    """The action mask written with ``-inf`` (``masked_fill(~avail, float('-inf'))``)."""
    torch.manual_seed(0)
    return MAPPOPolicy(fill=-float("inf"))


class ValueNorm(nn.Module):
    """MAPPO's ``ValueNorm``: debiased running mean and mean of squares of the returns.
    ``clamp_var``: MAPPO's ``clamp(min=1e-2)`` of ``E[x^2] - E[x]^2``."""

    def __init__(self, beta: float = 0.99999, epsilon: float = 1e-5, clamp_var: bool = True):
        super().__init__()
        self.beta, self.epsilon, self.clamp_var = beta, epsilon, clamp_var
        self.register_buffer("running_mean", torch.zeros(1))
        self.register_buffer("running_mean_sq", torch.zeros(1))
        self.register_buffer("debiasing_term", torch.zeros(1))

    def running_mean_var(self):
        debiased_mean = self.running_mean / self.debiasing_term.clamp(min=self.epsilon)
        debiased_mean_sq = self.running_mean_sq / self.debiasing_term.clamp(min=self.epsilon)
        debiased_var = debiased_mean_sq - debiased_mean ** 2
        if self.clamp_var:
            debiased_var = debiased_var.clamp(min=1e-2)
        return debiased_mean, debiased_var

    @torch.no_grad()
    def update(self, x):
        self.running_mean.mul_(self.beta).add_(x.mean() * (1.0 - self.beta))
        self.running_mean_sq.mul_(self.beta).add_((x ** 2).mean() * (1.0 - self.beta))
        self.debiasing_term.mul_(self.beta).add_(1.0 - self.beta)

    def forward(self, x):  # MAPPO's normalize()
        mean, var = self.running_mean_var()
        return (x - mean) / torch.sqrt(var)


class MAPPOLoss(nn.Module):
    """MAPPO's ``ppo_update`` as a loss module: the clipped surrogate over the active agents,
    the entropy bonus, and the Huber loss of V against the normalised returns."""

    def __init__(self, clip: float = 0.2, ent_coef: float = 0.01, clamp_var: bool = True,
                 entropy: str = "dist"):
        super().__init__()
        self.clip, self.ent_coef, self.entropy = clip, ent_coef, entropy
        self.value_norm = ValueNorm(clamp_var=clamp_var)

    def forward(self, logp, probs, dist_entropy, values, old_logp, adv, returns, active, avail):
        ratio = torch.exp(logp - old_logp)
        surr1 = ratio * adv
        surr2 = torch.clamp(ratio, 1.0 - self.clip, 1.0 + self.clip) * adv
        policy_loss = -(torch.min(surr1, surr2) * active).sum() / active.sum()
        if self.entropy == "masked_plogp":  # -sum p log p over the available actions only
            plogp = (probs * probs.log()).masked_fill(avail == 0, 0.0)
            dist_entropy = -plogp.sum(-1)
        entropy = (dist_entropy * active).sum() / active.sum()
        value_loss = F.huber_loss(values, self.value_norm(returns), delta=10.0)
        return policy_loss - self.ent_coef * entropy + value_loss


def joint_action_logp(probs, actions):
    """The joint action's log-probability as the log of the agents' probabilities' product."""
    taken = torch.gather(probs, -1, actions.unsqueeze(-1)).squeeze(-1)
    return torch.log(taken.prod(dim=-1))


def mappo_batch(seed: int = 0, n: int = 8, dead_only_noop: bool = True):
    """A rollout for MAPPO: episodes, the behaviour policy's log-probs, GAE advantages over
    the padded steps (bootstrapped from V, zeroed past termination) and their returns."""
    eps = [make_episode(seed + i, T, dead_only_noop) for i in range(n)]
    b = {k: torch.stack([e[k] for e in eps]) for k in eps[0]}
    gen = torch.Generator().manual_seed(seed)
    out = {"obs": b["obs"][:, :-1], "state": b["state"][:, :-1],
           "avail": b["avail"][:, :-1], "actions": b["actions"]}
    tm1 = T - 1
    values = torch.randn(n, T, generator=gen) * 0.1
    rewards, term, filled = b["reward"][..., 0], b["terminated"][..., 0], b["filled"][..., 0]
    out["adv"], out["returns"] = gae(rewards, values, term, filled)
    out["old_logp"] = -torch.rand(n, tm1, N_AGENTS, generator=gen) - 1.0
    alive = (b["avail"][:, :-1, :, 1:].sum(-1) > 0).float()  # MAPPO's active_masks
    out["active"] = alive * filled[:, :, None]
    return out


def gae(rewards, values, terminated, filled, gamma=0.99, lam=0.95):
    """GAE over padded episodes: no bootstrap past a terminal step, nothing past the end."""
    adv = torch.zeros_like(rewards)
    last = torch.zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        nonterminal = 1.0 - terminated[:, t]
        delta = rewards[:, t] + gamma * values[:, t + 1] * nonterminal - values[:, t]
        last = (delta + gamma * lam * nonterminal * last) * filled[:, t]
        adv[:, t] = last
    returns = adv + values[:, :-1]
    adv = adv[:, :, None].expand(-1, -1, N_AGENTS)
    return adv, returns[:, :, None].expand(-1, -1, N_AGENTS)
