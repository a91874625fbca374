"""Loss modules that hold the model and call it again inside their own call: a WGAN critic
loss with DRAGAN's gradient penalty on perturbed reals (a critic on count data,
Anscombe-transformed by ``2 sqrt(x + 3/8)``), a consistency loss on a posterized strong view
(a classifier standardising each row without eps), and a Hutchinson penalty on the input
Hessian through ``torch.autograd.functional.hvp`` next to a cross-entropy masked to the
labelled rows. ``Critic.trap``: a flag the loop sets around the loss call, which the replay
cannot know (state outside the model)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

D = 4


class Critic(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(D, 16)
        self.fc2 = nn.Linear(16, 1)
        self.trap = False

    def forward(self, x):
        h = F.leaky_relu(self.fc1(2 * torch.sqrt(x + 3 / 8)), 0.2)
        return self.fc2(torch.log(h) if self.trap else h)


class DraganLoss(nn.Module):
    def __init__(self, critic, lam: float = 10.0):
        super().__init__()
        self.critic, self.lam = critic, lam

    def forward(self, d_real, d_fake, real):
        x_hat = (real + 0.5 * real.std() * torch.randn_like(real)).requires_grad_(True)
        self.x_hat = x_hat.detach()  # (the test reads which rows left sqrt's domain)
        g, = torch.autograd.grad(self.critic(x_hat).sum(), x_hat, create_graph=True)
        return d_fake.mean() - d_real.mean() + self.lam * ((g.norm(2, dim=1) - 1) ** 2).mean()


def make_dragan():
    torch.manual_seed(0)
    critic = Critic()
    return {"model": critic, "loss_fn": DraganLoss(critic)}


class RowNorm(nn.Module):
    def forward(self, x):
        return (x - x.mean(1, keepdim=True)) / x.std(1, keepdim=True)


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.fc = RowNorm(), nn.Linear(8, 3)

    def forward(self, x):
        return self.fc(self.norm(x))


def posterize(x, levels: int = 2):
    return torch.floor(x * levels) / levels


class ConsistencyLoss(nn.Module):
    def __init__(self, model, lam: float = 1.0):
        super().__init__()
        self.model, self.lam = model, lam

    def forward(self, logits, y, x):
        strong = self.model(posterize(x))
        return F.cross_entropy(logits, y) + self.lam * F.kl_div(
            strong.log_softmax(1), logits.detach().softmax(1), reduction="batchmean")


def make_consistency():
    torch.manual_seed(0)
    model = Classifier()
    return {"model": model, "loss_fn": ConsistencyLoss(model)}


class Smooth(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 16), nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class HessianPenaltyLoss(nn.Module):
    def __init__(self, model, lam: float = 0.1):
        super().__init__()
        self.model, self.lam = model, lam

    def forward(self, logits, y, x):
        known = y >= 0  # (-1: an unlabelled row)
        ce = F.cross_entropy(logits, y.clamp_min(0), reduction="none")
        ce = (ce * known).sum() / known.sum()
        v = torch.randn_like(x)
        _, hv = torch.autograd.functional.hvp(
            lambda xx: self.model(xx).logsumexp(1).sum(), x, v, create_graph=True)
        return ce + self.lam * (hv * v).sum(1).pow(2).mean()


def make_hessian():
    torch.manual_seed(0)
    model = Smooth()
    return {"model": model, "loss_fn": HessianPenaltyLoss(model)}


def l2_normalize(d):
    return d / d.flatten(1).norm(dim=1).view(-1, 1)  # the bug: no eps, 0/0 at a zero gradient


class VATLoss(nn.Module):
    """Virtual adversarial training: the loss calls the model on x + xi d for the adversarial
    direction, then on x + r_adv for the smoothness term."""
    def __init__(self, model, xi: float = 10.0, eps: float = 1.0):
        super().__init__()
        self.model, self.xi, self.eps = model, xi, eps

    def forward(self, logits, y, x):
        pred = logits.detach().softmax(1)
        d = l2_normalize(torch.rand(x.shape) - 0.5).requires_grad_()
        adv = F.kl_div(self.model(x + self.xi * d).log_softmax(1), pred, reduction="batchmean")
        g, = torch.autograd.grad(adv, d)
        lds = F.kl_div(self.model(x + self.eps * l2_normalize(g)).log_softmax(1), pred,
                       reduction="batchmean")
        return F.cross_entropy(logits, y) + lds


def make_vat():
    torch.manual_seed(0)
    model = Smooth()
    return {"model": model, "loss_fn": VATLoss(model)}


def make_critic():
    torch.manual_seed(0)
    return Critic()


critic = make_critic()  # a script's model, which the loss function below reads as a global


def dragan_loss(d_real, d_fake, real):
    x_hat = (real + 0.5 * real.std() * torch.randn_like(real)).requires_grad_(True)
    g, = torch.autograd.grad(critic(x_hat).sum(), x_hat, create_graph=True)
    return d_fake.mean() - d_real.mean() + 10 * ((g.norm(2, dim=1) - 1) ** 2).mean()
