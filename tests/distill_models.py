"""Students, teachers and distillation losses for ``test_distillation``.

The factories and losses live at module level so that ``nanreplay`` rebuilds them from the
bundle (``distill_models:make_distiller``, ``distill_models:MaskedKD``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Net(nn.Module):
    """A small classifier: the student (narrow) or the teacher (wide, with dropout)."""

    def __init__(self, hidden: int = 16, p: float = 0.0, d_in: int = 12, classes: int = 10):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.bn = nn.BatchNorm1d(hidden)
        self.drop = nn.Dropout(p)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.fc2(self.drop(F.relu(self.bn(self.fc1(x)))))


def make_student() -> nn.Module:
    torch.manual_seed(1)
    return Net(hidden=16)


def make_teacher() -> nn.Module:
    torch.manual_seed(2)
    return Net(hidden=48, p=0.3)


class Distiller(nn.Module):
    """The student and its frozen teacher in one module (torchdistill's and many repos'
    layout): the teacher runs in eval mode under ``torch.inference_mode()`` (or
    ``torch.no_grad()``) inside the forward, which returns both logits."""

    def __init__(self, inference: bool = True):
        super().__init__()
        self.student = make_student()
        self.teacher = make_teacher().eval().requires_grad_(False)
        self.inference = inference

    def train(self, mode: bool = True):
        super().train(mode)
        self.teacher.eval()  # the teacher stays in eval mode
        return self

    def forward(self, x):
        with torch.inference_mode() if self.inference else torch.no_grad():
            t = self.teacher(x)
        return self.student(x), t


def make_distiller() -> nn.Module:
    return Distiller()


class KD(nn.Module):
    """Hinton's loss: KL of the softened distributions times T², plus cross entropy."""

    def __init__(self, temperature: float = 4.0, alpha: float = 0.5):
        super().__init__()
        self.temperature, self.alpha = temperature, alpha

    def forward(self, out, y):
        s, t = out
        T = self.temperature
        kd = F.kl_div(F.log_softmax(s / T, dim=-1), F.softmax(t / T, dim=-1),
                      reduction="batchmean") * T * T
        return self.alpha * kd + (1 - self.alpha) * F.cross_entropy(s, y)


class MaskedKD(nn.Module):
    """Hinton's loss over a vocabulary of which only the first ``allowed`` classes are live:
    both models' logits of the others are masked to -inf before the softmaxes."""

    def __init__(self, temperature: float = 2.0, allowed: int | None = None):
        super().__init__()
        self.temperature, self.allowed = temperature, allowed

    def forward(self, s, t, y):
        if self.allowed is not None:
            dead = torch.arange(s.shape[-1], device=s.device) >= self.allowed
            s = s.masked_fill(dead, float("-inf"))
            t = t.masked_fill(dead, float("-inf"))
        T = self.temperature
        kd = F.kl_div(F.log_softmax(s / T, dim=-1), F.softmax(t / T, dim=-1),
                      reduction="batchmean") * T * T
        return kd + F.cross_entropy(s, y)


class Pair(nn.Module):
    """Deep mutual learning's two networks in one module; each learns from the other."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.net1 = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 10))
        self.net2 = nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 10))

    def forward(self, x):
        return self.net1(x), self.net2(x)


def make_pair() -> nn.Module:
    return Pair()


class MutualKL(nn.Module):
    """Both networks' cross entropy plus each one's KL to the other's detached output."""

    def forward(self, out, y):
        a, b = out
        loss = F.cross_entropy(a, y) + F.cross_entropy(b, y)
        for p, q in ((a, b), (b, a)):
            loss = loss + F.kl_div(F.log_softmax(p, -1), F.softmax(q.detach(), -1),
                                   reduction="batchmean")
        return loss


class Masked(nn.Module):
    """A classifier whose classes from ``live`` on are masked to -inf in its own forward."""

    def __init__(self, net: nn.Module, live: int = 7):
        super().__init__()
        self.net = net
        self.register_buffer("dead", torch.arange(10) >= live)

    def forward(self, x):
        return self.net(x).masked_fill(self.dead, float("-inf"))


class MaskedDistiller(Distiller):
    """The distiller over a masked vocabulary: both models mask the dead classes."""

    def __init__(self):
        super().__init__(inference=False)
        self.student = Masked(self.student)
        self.teacher = Masked(self.teacher).eval()


def make_masked_distiller() -> nn.Module:
    return MaskedDistiller()


def peer_kl(a, b, y):
    """One network's loss in deep mutual learning: its cross entropy plus its KL to the peer's
    output ``b``, detached inside the loss (the peer's output keeps its graph outside it)."""
    return F.cross_entropy(a, y) + F.kl_div(F.log_softmax(a, -1), F.softmax(b.detach(), -1),
                                            reduction="batchmean")
