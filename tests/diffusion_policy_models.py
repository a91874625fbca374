"""Diffusion Policy (Chi et al.) as its code base writes it, for ``test_diffusion_policy``.

- ``EpisodeDataset``: episodes of proprioception, a depth image and actions, cut into windows
  of ``N_OBS`` observation steps and a ``HORIZON``-step action chunk (``SequenceSampler``);
  ``fit_range`` is ``LinearNormalizer.fit``'s per-dimension min / max over the whole dataset.
- ``Normalizer``: the ``[-1, 1]`` min-max normaliser, with (``range_eps``) or without
  Chi's guard for a dimension that never moves (a locked gripper: max == min).
- ``DepthEncoder``: a small ResNet over the depth frame (GroupNorm in place of BatchNorm, as
  ``replace_bn_with_gn`` does), its features flattened with the proprioception history.
- ``ConditionalUnet1D``: the 1-D temporal U-Net, each residual block FiLM-conditioned on the
  observation features and the sinusoidal diffusion-step embedding.
- ``DiffusionPolicy``: ``compute_loss``'s forward: normalise, draw the noise and a timestep
  per sample, noise the chunk with the squared-cosine schedule, predict the noise; optional
  gripper head (open / closed logit) for a ``gripper_bce`` written with ``where``.
- ``EMA``: the hand-written EMA of ``EMAModel`` (power-law warm-up of the decay).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

PROPRIO, ACT, N_OBS, HORIZON, STEPS, IMG = 4, 3, 2, 8, 100, 8
GRIP = 2  # the gripper's action dimension


def squared_cos_alphas_cumprod(steps: int = STEPS, s: float = 0.008,
                               max_beta: float = 0.999) -> torch.Tensor:
    """``betas_for_alpha_bar`` ("squaredcos_cap_v2"), betas capped at ``max_beta``."""
    f = [math.cos((i / steps + s) / (1 + s) * math.pi / 2) ** 2 for i in range(steps + 1)]
    betas = torch.tensor([min(1 - f[i + 1] / f[i], max_beta) for i in range(steps)])
    return torch.cumprod(1 - betas, 0)


def episodes(n: int = 6, length: int = 14, seed: int = 0):
    """Demonstrations: a smooth reach (x, y) with the gripper closed throughout (-1 raw, a
    locked gripper), joint readings, and a depth frame in metres."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        t = torch.linspace(0, 1, length)[:, None]
        goal = torch.rand(1, 2, generator=g) * 0.4 + 0.1
        xy = goal * t + 0.01 * torch.randn(length, 2, generator=g)
        act = torch.cat([xy, torch.full((length, 1), 0.04)], -1)  # gripper width: locked
        proprio = torch.cat([xy, torch.randn(length, PROPRIO - 2, generator=g) * 0.1], -1)
        depth = 0.5 + 0.5 * torch.rand(length, 1, IMG, IMG, generator=g)
        out.append({"proprio": proprio, "depth": depth, "action": act})
    return out


class EpisodeDataset(Dataset):
    """Windows ``(obs history, action chunk)`` over the episodes, ``SequenceSampler`` style."""

    def __init__(self, eps: list[dict]):
        self.eps = eps
        self.index = [(e, s) for e, ep in enumerate(eps)
                      for s in range(len(ep["action"]) - HORIZON + 1)]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        e, s = self.index[i]
        ep = self.eps[e]
        o = slice(s, s + N_OBS)
        return ep["proprio"][o], ep["depth"][o], ep["action"][s:s + HORIZON]


def fit_range(eps: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """``LinearNormalizer.fit(mode='limits')``: the action's per-dimension min and max."""
    a = torch.cat([ep["action"] for ep in eps])
    return a.min(0).values, a.max(0).values


class Normalizer(nn.Module):
    """Min-max to ``[-1, 1]``; ``range_eps`` None divides by the raw range (the bug)."""

    def __init__(self, lo: torch.Tensor, hi: torch.Tensor, range_eps: float | None = 1e-4):
        super().__init__()
        self.register_buffer("lo", lo.clone())
        self.register_buffer("hi", hi.clone())
        self.range_eps = range_eps

    @torch.no_grad()
    def fit(self, eps: list[dict]) -> None:
        """Refit on the training data (``policy.set_normalizer(dataset.get_normalizer())``)."""
        lo, hi = fit_range(eps)
        self.lo.copy_(lo)
        self.hi.copy_(hi)

    def forward(self, x):
        rng = self.hi - self.lo
        if self.range_eps is not None:  # Chi's guard: a dimension that never moves maps to 0
            still = rng < self.range_eps
            z = (x - self.lo) / torch.where(still, torch.ones_like(rng), rng) * 2 - 1
            return torch.where(still, x - self.lo, z)
        return (x - self.lo) / rng * 2 - 1


class GaussianNormalizer(nn.Module):
    """``LinearNormalizer(mode='gaussian')`` for the proprioception: ``(x - mean) / (std +
    eps)`` with the dataset's per-joint mean and std."""

    def __init__(self, eps: float = 1e-8):
        super().__init__()
        self.register_buffer("mean", torch.zeros(PROPRIO))
        self.register_buffer("std", torch.ones(PROPRIO))
        self.eps = eps

    @torch.no_grad()
    def fit(self, eps: list[dict]) -> None:
        x = torch.cat([ep["proprio"] for ep in eps])
        self.mean.copy_(x.mean(0))
        self.std.copy_(x.std(0))

    def forward(self, x):
        return (x - self.mean) / (self.std + self.eps)


class BasicBlock(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.gn1 = nn.GroupNorm(2, c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.gn2 = nn.GroupNorm(2, c)

    def forward(self, x):
        return F.relu(x + self.gn2(self.conv2(F.relu(self.gn1(self.conv1(x))))))


class DepthEncoder(nn.Module):
    """ResNet-ish: stem conv, one basic block, global average pool, linear."""

    def __init__(self, c: int = 8, out: int = 16):
        super().__init__()
        self.stem = nn.Conv2d(1, c, 3, padding=1, bias=False)
        self.gn = nn.GroupNorm(2, c)
        self.block = BasicBlock(c)
        self.fc = nn.Linear(c, out)

    def forward(self, x):
        x = self.block(F.relu(self.gn(self.stem(x))))
        return self.fc(x.mean((-2, -1)))


def sinusoidal_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``SinusoidalPosEmb``."""
    half = dim // 2
    freqs = torch.exp(torch.arange(half, device=t.device) * -(math.log(10000) / (half - 1)))
    x = t.float()[:, None] * freqs[None]
    return torch.cat([x.sin(), x.cos()], -1)


class FiLMBlock(nn.Module):
    """``ConditionalResidualBlock1D``: conv, FiLM ``scale * h + bias`` from the condition,
    conv, residual."""

    def __init__(self, cin: int, cout: int, cond: int):
        super().__init__()
        self.conv1 = nn.Sequential(nn.Conv1d(cin, cout, 3, padding=1), nn.GroupNorm(4, cout),
                                   nn.Mish())
        self.conv2 = nn.Sequential(nn.Conv1d(cout, cout, 3, padding=1), nn.GroupNorm(4, cout),
                                   nn.Mish())
        self.film = nn.Sequential(nn.Mish(), nn.Linear(cond, 2 * cout))
        self.res = nn.Conv1d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x, cond):
        scale, bias = self.film(cond)[..., None].chunk(2, 1)
        h = scale * self.conv1(x) + bias
        return self.conv2(h) + self.res(x)


class ConditionalUnet1D(nn.Module):
    def __init__(self, cond: int, c: int = 16, tdim: int = 16):
        super().__init__()
        self.tdim = tdim
        self.step_mlp = nn.Sequential(nn.Linear(tdim, 32), nn.Mish(), nn.Linear(32, tdim))
        k = cond + tdim
        self.down = FiLMBlock(ACT, c, k)
        self.pool = nn.Conv1d(c, c, 3, stride=2, padding=1)
        self.mid = FiLMBlock(c, 2 * c, k)
        self.up = nn.ConvTranspose1d(2 * c, c, 4, stride=2, padding=1)
        self.out_block = FiLMBlock(2 * c, c, k)
        self.final = nn.Conv1d(c, ACT, 1)

    def forward(self, x, t, cond):
        """``x`` ``(B, HORIZON, ACT)``, channels last as the policy holds it."""
        g = torch.cat([self.step_mlp(sinusoidal_embedding(t, self.tdim).to(x.dtype)), cond], -1)
        h1 = self.down(x.transpose(1, 2), g)
        h = self.up(self.mid(self.pool(h1), g))
        return self.final(self.out_block(torch.cat([h, h1], 1), g)).transpose(1, 2)


class DiffusionPolicy(nn.Module):
    """``DiffusionUnetImagePolicy.compute_loss`` as a forward: returns the predicted noise,
    the noise, and (with ``gripper_head``) the gripper's open / closed logits per step."""

    def __init__(self, lo, hi, range_eps: float | None = 1e-4, gripper_head: bool = False,
                 grip_bias: float = 0.0, steps: int = STEPS, max_beta: float = 0.999,
                 x0_loss: bool = False, clip_sample: bool = True):
        super().__init__()
        self.normalizer = Normalizer(lo, hi, range_eps)
        self.obs_normalizer = GaussianNormalizer()
        self.encoder = DepthEncoder()
        cond = N_OBS * (16 + PROPRIO)
        self.unet = ConditionalUnet1D(cond)
        self.steps, self.x0_loss, self.clip_sample = steps, x0_loss, clip_sample
        self.register_buffer("alphas_cumprod", squared_cos_alphas_cumprod(steps, max_beta=max_beta))
        self.gripper = nn.Linear(cond, HORIZON) if gripper_head else None
        if self.gripper is not None:
            nn.init.constant_(self.gripper.bias, grip_bias)

    def forward(self, proprio, depth, action):
        b = action.shape[0]
        feat = self.encoder(depth.flatten(0, 1)).reshape(b, -1)
        cond = torch.cat([feat, self.obs_normalizer(proprio).flatten(1)], -1)
        x0 = self.normalizer(action)
        noise = torch.randn_like(x0)
        t = torch.randint(0, self.steps, (b,), device=x0.device)
        ab = self.alphas_cumprod[t][:, None, None]
        noisy = ab.sqrt() * x0 + (1 - ab).sqrt() * noise
        pred = self.unet(noisy, t, cond)
        if self.x0_loss:  # the x0 the prediction implies, clipped as the sampler clips it
            x0_hat = (noisy - (1 - ab).sqrt() * pred) / ab.sqrt()
            x0_hat = x0_hat.clamp(-1, 1) if self.clip_sample else x0_hat
            return pred, noise, x0_hat, x0
        if self.gripper is None:
            return pred, noise
        return pred, noise, self.gripper(cond)


def make_policy(range_eps: float | None = 1e-4, **kw) -> DiffusionPolicy:
    torch.manual_seed(0)
    lo, hi = fit_range(episodes())
    return DiffusionPolicy(lo, hi, range_eps, **kw)


def make_policy_no_range_eps() -> DiffusionPolicy:
    return make_policy(range_eps=None)


def make_policy_gripper_head() -> DiffusionPolicy:
    """A gripper head whose bias starts at the dataset's prior: closed 99.99999% of steps."""
    return make_policy(gripper_head=True, grip_bias=18.0)


def make_policy_half() -> DiffusionPolicy:
    return make_policy().half()


class EpsilonLoss(nn.Module):
    """The epsilon-prediction MSE, with an optional gripper BCE term (``gripper_weight``) or
    an MSE of the clipped x0 the prediction implies (``x0_weight``, outputs of four)."""

    def __init__(self, gripper_weight: float = 0.0, x0_weight: float = 0.0):
        super().__init__()
        self.gripper_weight, self.x0_weight = gripper_weight, x0_weight

    def forward(self, out, closed=None):
        loss = F.mse_loss(out[0].float(), out[1].float())
        if len(out) == 4:
            return loss + self.x0_weight * F.mse_loss(out[2], out[3])
        if len(out) > 2:
            loss = loss + self.gripper_weight * gripper_bce(out[2], closed)
        return loss


def gripper_bce(logits, closed):
    """BCE of the gripper's closed probability, each branch written out with ``where``."""
    p = torch.sigmoid(logits)
    ll = torch.where(closed, torch.log(p), torch.log(1 - p))  # log(1 - 1) = -inf unselected
    return -ll.mean()


class EMA:
    """``EMAModel``: decay ``1 - (1 + step / inv_gamma) ** -power`` capped at ``max_decay``."""

    def __init__(self, model: nn.Module, power: float = 0.75, max_decay: float = 0.9999):
        self.shadow = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.power, self.max_decay, self.step = power, max_decay, 0

    @torch.no_grad()
    def update(self, model: nn.Module):
        decay = min(max(1 - (1 + self.step) ** -self.power, 0.0), self.max_decay)
        for k, v in model.state_dict().items():
            if v.dtype.is_floating_point:
                self.shadow[k].mul_(decay).add_(v.detach(), alpha=1 - decay)
            else:
                self.shadow[k].copy_(v)
        self.step += 1


def make_policy_gripper_open() -> DiffusionPolicy:
    """A gripper head whose bias starts at an 'open' prior of -18."""
    return make_policy(gripper_head=True, grip_bias=-18.0)


def make_policy_x0_uncapped() -> DiffusionPolicy:
    """An x0 auxiliary loss over a 10-step squared-cosine schedule whose betas are not capped:
    the last beta is 1, so alphas_cumprod ends at exactly 0."""
    return make_policy(steps=10, max_beta=1.0, x0_loss=True)


def make_policy_x0_unclipped() -> DiffusionPolicy:
    return make_policy(steps=10, max_beta=1.0, x0_loss=True, clip_sample=False)


def make_policy_half_no_range_eps() -> DiffusionPolicy:
    return make_policy(range_eps=None).half()


class DictEpisodeDataset(EpisodeDataset):
    """The windows as the code base's datasets give them: ``{"obs": {"agent_pos", "depth"},
    "action"}``, collated by the DataLoader into the same nesting."""

    def __getitem__(self, i):
        proprio, depth, action = super().__getitem__(i)
        return {"obs": {"agent_pos": proprio, "depth": depth}, "action": action}


class BatchPolicy(DiffusionPolicy):
    """``compute_loss(batch)``: the policy given the collated batch dictionary."""

    def forward(self, batch):
        return super().forward(batch["obs"]["agent_pos"], batch["obs"]["depth"],
                               batch["action"])


def make_batch_policy() -> BatchPolicy:
    torch.manual_seed(0)
    lo, hi = fit_range(episodes())
    return BatchPolicy(lo, hi)
