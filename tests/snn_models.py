"""A spiking network as snntorch users write it: leaky integrate-and-fire neurons whose
membrane potential is a module attribute carried across the time loop (reset by the training
loop before each batch, ``utils.reset(net)``), a Heaviside spike with a fast-sigmoid surrogate
gradient (a custom ``autograd.Function``), rate-coded inputs drawn with ``torch.rand`` in the
forward, and losses over spike counts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SLOPE = 25.0


class Spike(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return (x > 0).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad / (SLOPE * x.abs() + 1.0) ** 2


class Leaky(nn.Module):
    """snntorch.Leaky: ``mem`` lives on the module between time steps."""

    def __init__(self, beta: float = 0.9, threshold: float = 1.0):
        super().__init__()
        self.beta, self.threshold = beta, threshold
        self.mem = None

    def forward(self, x):
        if self.mem is None or self.mem.shape != x.shape:
            self.mem = torch.zeros_like(x)
        self.mem = self.beta * self.mem + x
        spk = Spike.apply(self.mem - self.threshold)
        self.mem = self.mem - spk * self.threshold  # reset by subtraction
        return spk


class SNN(nn.Module):
    def __init__(self, d_in: int = 64, hidden: int = 128, classes: int = 10, steps: int = 12):
        super().__init__()
        self.steps = steps
        self.fc1, self.lif1 = nn.Linear(d_in, hidden), Leaky()
        self.fc2, self.lif2 = nn.Linear(hidden, classes), Leaky()

    def forward(self, x):
        out = []
        for _ in range(self.steps):
            spikes_in = (torch.rand_like(x) < x).float()  # rate coding of intensities in [0, 1]
            out.append(self.lif2(self.fc2(self.lif1(self.fc1(spikes_in)))))
        return torch.stack(out)  # [time, batch, classes]


def reset(net: nn.Module) -> None:
    """snntorch.utils.reset: forget every neuron's membrane potential."""
    for m in net.modules():
        if isinstance(m, Leaky):
            m.mem = None


class SpikeRateNLL(nn.Module):
    """The output spike counts turned into class probabilities by normalising them, then
    NLL. The planted bug: a sample whose output layer stayed silent has counts summing to 0."""

    def forward(self, spikes, y):
        counts = spikes.sum(0)
        p = counts / counts.sum(1, keepdim=True)
        return F.nll_loss(torch.log(p + 1e-8), y)


class CountCE(nn.Module):
    """snntorch's ce_count_loss: cross entropy over spike counts (healthy)."""

    def forward(self, spikes, y):
        return F.cross_entropy(spikes.sum(0), y)


def make_snn() -> SNN:
    return SNN()


def data(n: int, seed: int):
    """Intensities in [0, 1] with a class-dependent bright band; a few blank images."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 10, (n,), generator=g)
    x = torch.rand(n, 64, generator=g) * 0.2
    for i in range(n):
        x[i, 6 * y[i]: 6 * y[i] + 6] += 0.7
    return x.clamp(0, 1), y
