"""Certified-robustness training written by hand, as auto_LiRPA's examples, CROWN-IBP
(Zhang et al. 2020) and Gowal et al.'s IBP write it, for ``test_certified_robustness``.

- ``CrownIBPNet``: a small MLP whose ``forward(x, eps)`` returns the clean logits and the
  lower bounds of the margins ``z_y - z_j`` over the L-inf ball of radius ``eps``: interval
  bounds in centre-radius form (``W mu + b``, ``|W| r``) through the hidden layers, then a
  CROWN relaxation of the last hidden ReLU (upper line slope ``u / (u - l)`` for unstable
  neurons) with the specification matrix folded into the last layer. ``guard``: ``"lirpa"``,
  auto_LiRPA's ``u = max(u.clamp(min=0), l.clamp(max=0) + 1e-8)`` before the slope;
  ``"naive"``, the same eps added to the unclamped ``l``, which float32 rounds away.
- ``ibp_loss``: CE on the clean logits mixed with CE on ``-margin_lb`` (the worst-case logits).
- ``eps_schedule``: auto_LiRPA's ``LinearScheduler``, 0 for the warm-up steps then a ramp.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

N, D, H, K = 16, 20, 32, 4


def spec_matrix(y: torch.Tensor, k: int) -> torch.Tensor:
    """C (B, K-1, K): rows e_y - e_j for every j != y (auto_LiRPA's ``C`` for verification)."""
    eye = torch.eye(k)
    c = eye[y].unsqueeze(1) - eye.unsqueeze(0)  # (B, K, K)
    keep = torch.arange(k)[None, :] != y[:, None]
    return c[keep].view(len(y), k - 1, k)


def interval_linear(layer: nn.Linear, lo, hi):
    mu, r = (hi + lo) / 2, (hi - lo) / 2
    mu = F.linear(mu, layer.weight, layer.bias)
    r = F.linear(r, layer.weight.abs())
    return mu - r, mu + r


class CrownIBPNet(nn.Module):
    def __init__(self, guard: str = ""):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(D, H), nn.Linear(H, H), nn.Linear(H, K)
        self.guard = guard

    def forward(self, x, eps, y):
        logits = self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))
        lo, hi = (x - eps).clamp(0, 1), (x + eps).clamp(0, 1)
        lo, hi = interval_linear(self.fc1, lo, hi)
        lo, hi = interval_linear(self.fc2, lo.relu(), hi.relu())
        return logits, self.crown_last(lo, hi, spec_matrix(y, K), x, eps)

    def crown_last(self, lo, up, c, x, eps):
        """Backward (CROWN) bound of C fc3(relu(h)) for h in [lo, up]; the inner layers' bounds
        are IBP's (CROWN-IBP). The lower bound takes the upper or lower ReLU line by the sign
        of the coefficient."""
        a = c @ self.fc3.weight  # (B, K-1, H)
        ub_r, lb_r = up, lo
        if self.guard == "naive":  # the bug: 1e-8 is below float32's spacing at |l| ~ 0.5
            ub_r = torch.max(up, lo + 1e-8)
        elif self.guard == "lirpa":  # auto_LiRPA's: clamped first, so the eps is added to 0
            ub_r, lb_r = up.clamp(min=0), lo.clamp(max=0)
            ub_r = torch.max(ub_r, lb_r + 1e-8)
        unstable = ((lo < 0) & (up > 0)).float()
        active = (lo >= 0).float()
        upper_d = ub_r / (ub_r - lb_r)  # the bug: x/0 where up == lo (eps 0, a flat box)
        d_up = unstable * upper_d + active
        b_up = -unstable * upper_d * lo
        d_lo = unstable * (up > -lo).float() + active  # the adaptive lower line
        d = torch.where(a >= 0, d_lo.unsqueeze(1), d_up.unsqueeze(1))
        b = torch.where(a >= 0, torch.zeros_like(b_up).unsqueeze(1), b_up.unsqueeze(1))
        # The linear bound on relu(h) holds for h in [lo, up]; take its minimum over the box.
        w = a * d
        mid, rad = (up + lo) / 2, (up - lo) / 2
        lb = (w @ mid.unsqueeze(-1)).squeeze(-1) - (w.abs() @ rad.unsqueeze(-1)).squeeze(-1)
        return lb + (a * b).sum(-1) + c @ self.fc3.bias


def make_crown() -> nn.Module:
    torch.manual_seed(0)
    return CrownIBPNet()


def make_crown_naive_guard() -> nn.Module:
    torch.manual_seed(0)
    return CrownIBPNet(guard="naive")


def make_crown_guarded() -> nn.Module:
    torch.manual_seed(0)
    return CrownIBPNet(guard="lirpa")


def ibp_loss(logits, margin_lb, y, kappa: float = 0.5):
    """kappa * CE(clean) + (1 - kappa) * CE of the worst-case logits (``-margin_lb`` padded
    with 0 for the true class, CROWN-IBP's ``robust_ce``)."""
    worst = torch.cat([torch.zeros_like(margin_lb[:, :1]), -margin_lb], 1)
    return kappa * F.cross_entropy(logits, y) + (1 - kappa) * F.cross_entropy(
        worst, torch.zeros_like(y))


def eps_schedule(step: int, warmup: int, ramp: int, eps_max: float) -> float:
    """auto_LiRPA's LinearScheduler: 0 during warm-up, then linear to ``eps_max``."""
    if step < warmup:
        return 0.0
    return eps_max * min(1.0, (step - warmup + 1) / ramp)


def batch(g: torch.Generator):
    x = torch.rand(N, D, generator=g)
    y = torch.randint(0, K, (N,), generator=g)
    return x, y


class DeepIBPNet(nn.Module):
    """Gowal et al.'s IBP on a deep, wide MLP (their "large" model's depth), trained under
    float16 autocast: ``forward(x, eps)`` returns the logits and the IBP bounds of the
    logits themselves (``robust_ce`` takes the upper bound of the wrong classes)."""

    def __init__(self, depth: int = 14, width: int = 128):
        super().__init__()
        dims = [D] + [width] * depth
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))
        self.head = nn.Linear(width, K)

    def forward(self, x, eps):
        h, lo, hi = x, (x - eps).clamp(0, 1), (x + eps).clamp(0, 1)
        for layer in self.layers:
            h = F.relu(layer(h))
            lo, hi = interval_linear(layer, lo, hi)
            lo, hi = lo.relu(), hi.relu()
        lo, hi = interval_linear(self.head, lo, hi)
        return self.head(h), lo, hi


def make_deep_ibp() -> nn.Module:
    torch.manual_seed(0)
    return DeepIBPNet()


def deep_ibp_loss(logits, lo, hi, y, kappa: float = 0.5):
    """IBP's worst-case logits: the true class's lower bound, the others' upper bounds."""
    onehot = F.one_hot(y, K).bool()
    worst = torch.where(onehot, lo, hi)
    return kappa * F.cross_entropy(logits, y) + (1 - kappa) * F.cross_entropy(worst, y)


class NoiseClassifier(nn.Module):
    """Cohen et al.'s base classifier for randomized smoothing: ``forward(x, m)`` classifies
    ``m`` Gaussian-noised copies of each input (sample-major), noise of ``sigma``."""

    def __init__(self, sigma: float = 0.25):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, H), nn.ReLU(),
                                 nn.Linear(H, K))
        self.sigma = sigma

    def forward(self, x, m: int = 4):
        noisy = x.repeat_interleave(m, 0)
        return self.net(noisy + torch.randn_like(noisy) * self.sigma)


def make_smoothing() -> nn.Module:
    torch.manual_seed(0)
    return NoiseClassifier()


def radius_loss(logits, y, m: int = 4, sigma: float = 0.25, gamma: float = 2.0,
                lam: float = 1.0):
    """CE plus a hinge on the soft certified radius ``sigma * Φ⁻¹(p_A)`` of the smoothed
    classifier (``torch.special.ndtri``); p_A clamped to (1e-8, 1 - 1e-8) as the code means
    to keep Φ⁻¹ finite (the bug: float32 rounds 1 - 1e-8 to 1)."""
    p = F.softmax(logits, 1).view(len(y), m, -1).mean(1)
    p_a = p.gather(1, y[:, None]).squeeze(1).clamp(1e-8, 1 - 1e-8)
    radius = sigma * torch.special.ndtri(p_a)
    return F.nll_loss(torch.log(p + 1e-10), y) + lam * F.relu(gamma - radius).mean()
