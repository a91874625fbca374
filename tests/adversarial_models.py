"""Adversarial training and certified robustness as the well-known repositories write it:
a small CIFAR-style convnet behind a per-channel normalisation layer (a ``std`` buffer, as
RobustBench's models hold it), PGD-Linf / PGD-L2 inner loops with ``torch.autograd.grad`` of
the loss w.r.t. the input, TRADES' ``KLDivLoss(reduction="batchmean")`` between the
adversarial log-softmax and the clean softmax, an input-gradient-norm penalty
(``create_graph=True``), and MACER's certified radius on Gaussian-noised copies."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

C, H, K = 3, 8, 10  # channels, image side, classes


class Normalize(nn.Module):
    """``(x - mean) / std`` per channel, the statistics as buffers."""

    def __init__(self, mean, std):
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(std).view(1, -1, 1, 1))

    def forward(self, x):
        return (x - self.mean) / self.std


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = Normalize([0.49, 0.48, 0.45], [0.25, 0.24, 0.26])
        self.conv1 = nn.Conv2d(C, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 16, 3, stride=2, padding=1)
        self.fc = nn.Linear(16 * (H // 2) ** 2, K)

    def forward(self, x):
        h = F.relu(self.conv1(self.norm(x)))
        h = F.relu(self.conv2(h))
        return self.fc(h.flatten(1))


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return Net()


def images(g: torch.Generator, n: int):
    x = torch.rand(n, C, H, H, generator=g)
    y = torch.randint(0, K, (n,), generator=g)
    return x, y


def pgd_linf(model, x, y, eps=8 / 255, alpha=2 / 255, steps=3, g=None):
    """Madry et al.'s PGD: uniform start in the eps-ball, sign steps, projection."""
    was = model.training
    model.eval()
    delta = (torch.rand(x.shape, generator=g) * 2 - 1) * eps
    x_adv = (x + delta).clamp(0, 1).detach()
    for _ in range(steps):
        x_adv.requires_grad_(True)
        loss = F.cross_entropy(model(x_adv), y)
        (grad,) = torch.autograd.grad(loss, x_adv)
        x_adv = x_adv.detach() + alpha * grad.sign()
        x_adv = torch.min(torch.max(x_adv, x - eps), x + eps).clamp(0, 1)
    model.train(was)
    return x_adv.detach()


def pgd_l2(model, x, y, eps=0.5, alpha=0.2, steps=3, tiny=0.0):
    """PGD-L2 early-stopped as FAT (Zhang et al. 2020) runs it: only the samples the model
    still classifies correctly are attacked (a per-sample mask on the attack's loss); the
    gradient normalised per sample by its 2-norm (``tiny``: the guard advertorch's
    ``normalize_by_pnorm`` has), then projected onto the L2 ball and [0, 1]."""
    was = model.training
    model.eval()
    x_adv = x.clone().detach()
    for _ in range(steps):
        x_adv.requires_grad_(True)
        out = model(x_adv)
        active = (out.argmax(1) == y).float()
        loss = (F.cross_entropy(out, y, reduction="none") * active).sum()
        (grad,) = torch.autograd.grad(loss, x_adv)
        gnorm = grad.flatten(1).norm(dim=1).view(-1, 1, 1, 1)
        x_adv = x_adv.detach() + alpha * grad / gnorm.clamp_min(tiny)
        d = x_adv - x
        dn = d.flatten(1).norm(dim=1).view(-1, 1, 1, 1)
        x_adv = (x + d * torch.clamp(eps / (dn + 1e-12), max=1.0)).clamp(0, 1)
    model.train(was)
    return x_adv.detach()


def trades_loss(adv_logits, nat_logits, y, beta=6.0, log_of_softmax=False):
    """TRADES: natural CE + beta * KL(clean || adversarial), batchmean. ``log_of_softmax``:
    the adversarial log-probabilities taken as ``torch.log(softmax)`` (a common rewrite)."""
    if log_of_softmax:
        adv_logp = torch.log(F.softmax(adv_logits, dim=1))
    else:
        adv_logp = F.log_softmax(adv_logits, dim=1)
    kl = nn.KLDivLoss(reduction="batchmean")(adv_logp, F.softmax(nat_logits, dim=1))
    return F.cross_entropy(nat_logits, y) + beta * kl


def input_grad_penalty(logits, y, x, lam=0.1, eps=0.0):
    """Double backprop (Drucker & LeCun; Ross & Doshi-Velez): CE + lam * ||d CE / dx||_2 per
    sample, the norm written as ``sqrt(sum g^2 + eps)``."""
    ce = F.cross_entropy(logits, y)
    (g,) = torch.autograd.grad(ce, x, create_graph=True)
    gn = torch.sqrt(g.flatten(1).pow(2).sum(1) + eps)
    return ce + lam * gn.mean()


def macer_loss(logits, y, m: int = 4, sigma: float = 0.25, gamma: float = 8.0,
               beta: float = 16.0, lbd: float = 12.0, clamp: bool = False):
    """MACER (Zhai et al. 2020): ``logits`` of ``m`` Gaussian-noised copies of each image
    (sample-major); the soft smoothed classifier's top two probabilities give the certified
    radius ``sigma / 2 * (Φ⁻¹(p_A) - Φ⁻¹(p_B))``, whose hinge is trained on the correct
    samples with a finite radius below ``gamma``. Its code clamps p to [0.02, 0.98] first
    (``clamp``)."""
    p = F.softmax(beta * logits, 1).view(len(y), m, -1).mean(1)
    ce = F.nll_loss(torch.log(F.softmax(logits, 1).view(len(y), m, -1).mean(1) + 1e-10), y)
    top2, idx = p.topk(2, 1)
    if clamp:
        top2 = top2.clamp(0.02, 0.98)
    normal = torch.distributions.Normal(0.0, 1.0)
    rad = normal.icdf(top2[:, 0]) - normal.icdf(top2[:, 1])
    keep = (idx[:, 0] == y) & torch.isfinite(rad) & (rad.abs() <= gamma)
    robust = (gamma + 1e-3 - rad[keep]).sum() * sigma / 2 / len(y)
    return ce + lbd * robust


class AttackerModel(nn.Module):
    """MadryLab robustness's ``AttackerModel``: ``forward(x, target, make_adv=True)`` runs the
    attack itself (PGD-L2, FAT's early stop) around the classifier, then classifies the
    adversarial example; the attack runs in eval mode with gradients on."""

    def __init__(self, tiny: float = 0.0):
        super().__init__()
        self.model = Net()
        self.tiny = tiny

    def forward(self, x, target=None, make_adv: bool = False):
        if make_adv:
            with torch.enable_grad():
                x = pgd_l2(self.model, x, target, tiny=self.tiny)
        return self.model(x)


def make_attacker() -> nn.Module:
    torch.manual_seed(0)
    return AttackerModel()


def pgd_push_down(model, x, y, eps=8 / 255, alpha=2 / 255, steps=3, g=None):
    """PGD on a delta leaf (``delta.requires_grad_()``, ``model(x + delta)``) whose attack loss
    pushes the true class's probability down as ``-log(1 - p_y)``, written without an eps."""
    model.eval()
    delta = ((torch.rand(x.shape, generator=g) * 2 - 1) * eps).requires_grad_(True)
    for _ in range(steps):
        p = F.softmax(model(x + delta), 1)
        loss = -torch.log(1 - p.gather(1, y[:, None])).sum()
        (grad,) = torch.autograd.grad(loss, delta)
        delta = (delta + alpha * grad.sign()).clamp(-eps, eps).detach().requires_grad_(True)
    model.train()
    return (x + delta).clamp(0, 1).detach()
