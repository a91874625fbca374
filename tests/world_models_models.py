"""A DreamerV3 agent as its PyTorch ports write it (NM512/dreamerv3-torch): an RSSM with a
GRU deterministic state and categorical stochastic latents (straight-through samples, 1%
unimix), symlog observations, two-hot reward and value heads, KL balancing with free bits,
and an actor-critic trained on imagined rollouts with a slow EMA target critic and
percentile return normalisation. Sizes are tiny; the idioms are the repositories'."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

OBS, ACT = 8, 3
DETER, STOCH, CLASSES, HIDDEN = 16, 4, 4, 32
BINS = 21


def symlog(x):
    return torch.sign(x) * torch.log1p(torch.abs(x))


def symexp(x):
    return torch.sign(x) * (torch.exp(torch.abs(x)) - 1)


BUCKETS = torch.linspace(-20.0, 20.0, BINS)


def twohot(x, bins=BUCKETS):
    """Two-hot encoding of symlog targets: weight split between the two nearest bins."""
    x = x.clamp(bins[0], bins[-1])
    above = torch.bucketize(x, bins).clamp(1, len(bins) - 1)
    below = above - 1
    w_above = (x - bins[below]) / (bins[above] - bins[below])
    return (F.one_hot(below, len(bins)) * (1 - w_above)[..., None]
            + F.one_hot(above, len(bins)) * w_above[..., None])


def twohot_mean(logits, bins=BUCKETS):
    """The head's mean, summed symmetrically about the middle bin as DreamerV3 does, so that
    uniform probabilities (a zero-initialised head) predict exactly 0."""
    probs, m = torch.softmax(logits, -1), len(bins) // 2
    side = (probs[..., :m] * bins[:m]).flip(-1) + probs[..., m + 1:] * bins[m + 1:]
    return symexp(probs[..., m] * bins[m] + side.sum(-1))


def twohot_loss(logits, target):
    """Cross entropy of the head's bins against the two-hot symlog target."""
    return -(twohot(symlog(target)) * torch.log_softmax(logits, -1)).sum(-1)


def mlp(inp, out, zero_out=False):
    net = nn.Sequential(nn.Linear(inp, HIDDEN), nn.LayerNorm(HIDDEN), nn.SiLU(),
                        nn.Linear(HIDDEN, out))
    if zero_out:  # DreamerV3 zero-initialises the reward and critic outputs
        nn.init.zeros_(net[-1].weight)
        nn.init.zeros_(net[-1].bias)
    return net


class RSSM(nn.Module):
    def __init__(self, unimix: float = 0.01):
        super().__init__()
        self.unimix = unimix
        self.img_in = nn.Sequential(nn.Linear(STOCH * CLASSES + ACT, HIDDEN), nn.SiLU())
        self.gru = nn.GRUCell(HIDDEN, DETER)
        self.prior_net = mlp(DETER, STOCH * CLASSES)
        self.post_net = mlp(DETER + HIDDEN, STOCH * CLASSES)

    def probs(self, logits):
        probs = torch.softmax(logits.reshape(*logits.shape[:-1], STOCH, CLASSES), -1)
        if self.unimix:
            probs = (1 - self.unimix) * probs + self.unimix / CLASSES
        return probs

    def sample(self, probs):
        """A one-hot sample with straight-through gradients."""
        idx = torch.multinomial(probs.reshape(-1, CLASSES), 1).reshape(probs.shape[:-1])
        onehot = F.one_hot(idx, CLASSES).float()
        return (onehot + probs - probs.detach()).flatten(-2)

    def img_step(self, deter, stoch, action):
        deter = self.gru(self.img_in(torch.cat([stoch, action], -1)), deter)
        prior = self.probs(self.prior_net(deter))
        return deter, self.sample(prior), prior

    def obs_step(self, deter, stoch, action, embed):
        deter, _, prior = self.img_step(deter, stoch, action)
        post = self.probs(self.post_net(torch.cat([deter, embed], -1)))
        return deter, self.sample(post), post, prior


class WorldModel(nn.Module):
    def __init__(self, unimix: float = 0.01):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(OBS, HIDDEN), nn.LayerNorm(HIDDEN), nn.SiLU())
        self.rssm = RSSM(unimix)
        feat = DETER + STOCH * CLASSES
        self.decoder = mlp(feat, OBS)
        self.reward = mlp(feat, BINS, zero_out=True)
        self.cont = mlp(feat, 1)


class Agent(nn.Module):
    """World model, actor, critic and the slow target critic in one module; ``forward`` is the
    world model's observation of a (B, T) sequence batch from the replay buffer."""

    def __init__(self, unimix: float = 0.01):
        super().__init__()
        self.wm = WorldModel(unimix)
        feat = DETER + STOCH * CLASSES
        self.actor = mlp(feat, ACT)
        self.critic = mlp(feat, BINS, zero_out=True)
        self.slow_critic = copy.deepcopy(self.critic).requires_grad_(False)

    def forward(self, obs, action, is_first):
        b, t = obs.shape[:2]
        embed = self.wm.encoder(symlog(obs))
        deter = obs.new_zeros(b, DETER)
        stoch = obs.new_zeros(b, STOCH * CLASSES)
        feats, posts, priors, samples = [], [], [], []
        for i in range(t):
            keep = 1.0 - is_first[:, i, None]  # reset the state where an episode began
            deter, stoch, post, prior = self.wm.rssm.obs_step(
                deter * keep, stoch * keep, action[:, i] * keep, embed[:, i])
            feats.append(torch.cat([deter, stoch], -1))
            posts.append(post)
            samples.append(stoch.reshape(b, STOCH, CLASSES))
            priors.append(prior)
        feat = torch.stack(feats, 1)
        return {"feat": feat, "post": torch.stack(posts, 1), "prior": torch.stack(priors, 1),
                "sample": torch.stack(samples, 1),
                "recon": self.wm.decoder(feat), "reward": self.wm.reward(feat),
                "cont": self.wm.cont(feat).squeeze(-1)}


def make_agent() -> Agent:
    torch.manual_seed(0)
    return Agent()


def make_agent_without_unimix() -> Agent:
    """An agent whose latents lack the 1% unimix, as resumed from a long run: its posterior
    has grown confident (logits spread over ~100), which plain softmax rounds to exact 0s."""
    torch.manual_seed(0)
    agent = Agent(unimix=0.0)
    with torch.no_grad():
        agent.wm.rssm.post_net[-1].weight.mul_(100.0)
    return agent


def kl(p, q):
    """KL(p || q) of categorical latents, summed over the stochastic variables."""
    return (p * (torch.log(p) - torch.log(q))).sum((-2, -1))


class WorldModelLoss(nn.Module):
    """DreamerV3's world-model loss: symlog reconstruction, two-hot reward, continue flag,
    dynamics and representation KL with free bits."""

    def __init__(self, free: float = 1.0, dyn_scale: float = 0.5, rep_scale: float = 0.1):
        super().__init__()
        self.free, self.dyn_scale, self.rep_scale = free, dyn_scale, rep_scale

    def latents(self, out):
        return out["post"], out["prior"]

    def forward(self, out, obs, reward, cont):
        post, prior = self.latents(out)
        dyn = torch.maximum(kl(post.detach(), prior), torch.tensor(self.free))
        rep = torch.maximum(kl(post, prior.detach()), torch.tensor(self.free))
        recon = ((out["recon"] - symlog(obs)) ** 2).sum(-1)
        rew = twohot_loss(out["reward"], reward)
        con = F.binary_cross_entropy_with_logits(out["cont"], cont, reduction="none")
        return (recon + rew + con + self.dyn_scale * dyn + self.rep_scale * rep).mean()


class SampledKLLoss(WorldModelLoss):
    """The KL taken of the posterior's straight-through one-hot sample instead of its
    probabilities: two one-hot distributions, whose log of 0 the KL multiplies by 0."""

    def latents(self, out):
        return out["sample"], out["prior"]


def imagine(agent, feat, horizon):
    """Roll the learned model forward from posterior states under the actor's actions."""
    deter, stoch = feat[:, :DETER], feat[:, DETER:]
    feats, logps, ents = [feat], [], []
    for _ in range(horizon):
        logits = agent.actor(feat.detach())
        probs = 0.99 * torch.softmax(logits, -1) + 0.01 / ACT
        action = F.one_hot(torch.multinomial(probs, 1)[:, 0], ACT).float()
        logps.append(torch.log((probs * action).sum(-1)))
        ents.append(-(probs * torch.log(probs)).sum(-1))
        deter, stoch, _ = agent.wm.rssm.img_step(deter, stoch, action)
        feat = torch.cat([deter, stoch], -1)
        feats.append(feat)
    return torch.stack(feats, 1), torch.stack(logps, 1), torch.stack(ents, 1)


def lambda_returns(reward, value, cont, gamma=0.997, lam=0.95):
    """TD(lambda) returns computed backwards over the horizon."""
    rets = [value[:, -1]]
    for t in reversed(range(reward.shape[1])):
        nxt = (1 - lam) * value[:, t + 1] + lam * rets[0]
        rets.insert(0, reward[:, t] + gamma * cont[:, t] * nxt)
    return torch.stack(rets[:-1], 1)


class ReturnNorm:
    """DreamerV3's return scale: an EMA of the 5th-95th percentile range, floored at 1."""

    def __init__(self, decay=0.99, floor=True):
        self.decay, self.floor, self.low, self.high = decay, floor, None, None

    def __call__(self, ret):
        low, high = torch.quantile(ret.detach().flatten(), torch.tensor([0.05, 0.95]))
        self.low = low if self.low is None else self.decay * self.low + (1 - self.decay) * low
        self.high = high if self.high is None else self.decay * self.high + (1 - self.decay) * high
        scale = self.high - self.low
        return torch.maximum(torch.ones(()), scale) if self.floor else scale


def behavior_losses(agent, feat, norm, horizon=5):
    """Actor and critic losses on an imagined rollout (REINFORCE for discrete actions)."""
    feats, logp, ent = imagine(agent, feat.detach().flatten(0, 1), horizon)
    with torch.no_grad():
        reward = twohot_mean(agent.wm.reward(feats[:, 1:]))
        cont = torch.sigmoid(agent.wm.cont(feats[:, 1:])).squeeze(-1)
        value = twohot_mean(agent.critic(feats))
        ret = lambda_returns(reward, value, cont)
        adv = (ret - value[:, :-1]) / norm(ret)
    actor_loss = -(logp * adv + 3e-4 * ent).mean()
    target = ret.detach()
    slow = twohot_mean(agent.slow_critic(feats[:, :-1].detach())).detach()
    logits = agent.critic(feats[:, :-1].detach())
    critic_loss = (twohot_loss(logits, target) + twohot_loss(logits, slow)).mean()
    return actor_loss, critic_loss


def mse_behavior_losses(agent, feat, norm, horizon=5):
    """DreamerV3's ``symlog_mse`` critic instead of the two-hot one: one output in symlog
    space, decoded with symexp for the returns, its exponent unclamped."""
    feats, logp, ent = imagine(agent, feat.detach().flatten(0, 1), horizon)
    with torch.no_grad():
        reward = twohot_mean(agent.wm.reward(feats[:, 1:]))
        cont = torch.sigmoid(agent.wm.cont(feats[:, 1:])).squeeze(-1)
        value = symexp(agent.critic(feats)[..., 0])
        ret = lambda_returns(reward, value, cont)
        adv = (ret - value[:, :-1]) / norm(ret)
    actor_loss = -(logp * adv + 3e-4 * ent).mean()
    pred = agent.critic(feats[:, :-1].detach())[..., 0]
    return actor_loss, ((pred - symlog(ret)) ** 2).mean()


def make_agent_diverged_critic() -> Agent:
    """An agent resumed from a run whose critic diverged: it predicts ~90 in symlog space."""
    agent = make_agent()
    with torch.no_grad():
        agent.critic[-1].bias.fill_(90.0)
    return agent


@torch.no_grad()
def update_slow(agent, fraction=0.02):
    for s, p in zip(agent.slow_critic.parameters(), agent.critic.parameters()):
        s.mul_(1 - fraction).add_(fraction * p)


def sequences(step, batch=4, length=6, seed=0, sparse=False):
    """A replay-buffer sample: (B, T) observations, one-hot actions, rewards, flags; a sparse
    reward task's first episodes found no reward (all 0)."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    obs = torch.randn(batch, length, OBS, generator=g) * 3
    action = F.one_hot(torch.randint(0, ACT, (batch, length), generator=g), ACT).float()
    reward = torch.randn(batch, length, generator=g) * (not sparse)
    is_first = torch.zeros(batch, length)
    is_first[:, 0] = 1
    cont = torch.ones(batch, length)
    return obs, action, reward, is_first, cont


def make_actor() -> nn.Module:
    """The agent's actor alone, as a second recorder given the actor's optimizer rebuilds it."""
    return make_agent().actor
