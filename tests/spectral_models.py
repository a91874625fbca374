"""A Fourier neural operator (FNO-1d) written as the reference code writes it: spectral
convolutions with complex weights applied to an ``rfft`` of the signal, trained with the
relative L2 loss of operator learning."""

import torch
import torch.nn.functional as F
from torch import nn


class SpectralConv1d(nn.Module):
    """Multiply the lowest ``modes`` Fourier modes by learned complex weights."""

    def __init__(self, cin, cout, modes):
        super().__init__()
        self.modes = modes
        scale = 1 / (cin * cout)
        self.weights = nn.Parameter(scale * torch.rand(cin, cout, modes, dtype=torch.cfloat))

    def forward(self, x):
        x_ft = torch.fft.rfft(x)
        out_ft = torch.zeros(x.shape[0], self.weights.shape[1], x.size(-1) // 2 + 1,
                             device=x.device, dtype=torch.cfloat)
        out_ft[:, :, :self.modes] = torch.einsum("bix,iox->box", x_ft[:, :, :self.modes], self.weights)
        return torch.fft.irfft(out_ft, n=x.size(-1))


class FNO1d(nn.Module):
    """Lift (value, grid position) to ``width`` channels, 3 Fourier layers, project to 1."""

    def __init__(self, modes=8, width=16):
        super().__init__()
        self.fc0 = nn.Linear(2, width)
        self.convs = nn.ModuleList([SpectralConv1d(width, width, modes) for _ in range(3)])
        self.ws = nn.ModuleList([nn.Conv1d(width, width, 1) for _ in range(3)])
        self.fc1 = nn.Linear(width, 64)
        self.fc2 = nn.Linear(64, 1)

    def forward(self, x):
        grid = torch.linspace(0, 1, x.shape[1]).reshape(1, -1, 1).expand(x.shape[0], -1, -1)
        x = self.fc0(torch.cat((x, grid), dim=-1)).permute(0, 2, 1)
        for conv, w in zip(self.convs, self.ws):
            x = F.gelu(conv(x) + w(x))
        return self.fc2(F.gelu(self.fc1(x.permute(0, 2, 1))))


class RelL2(nn.Module):
    """The relative L2 loss FNO code trains with."""
    def forward(self, pred, y):
        diff = (pred - y).flatten(1).norm(dim=1)
        return (diff / y.flatten(1).norm(dim=1)).mean()


def make_fno():
    return FNO1d()


class ComplexNet(nn.Module):
    """A complex-valued net on a complex batch (MRI k-space, a radar return): a complex
    Linear, then a classifier on the magnitudes."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16, dtype=torch.complex64)
        self.head = nn.Linear(16, 3)

    def forward(self, z):
        return self.head(self.lin(z).abs())


def make_complex_net():
    torch.manual_seed(0)
    return ComplexNet()
