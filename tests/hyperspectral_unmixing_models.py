"""Hyperspectral unmixing models of ``tests/test_hyperspectral_unmixing.py``, written as the
unmixing literature writes them: a pixel autoencoder whose decoder is a bias-free linear layer
holding the endmembers in its weight (bands x endmembers), abundances from a softmax over the
encoder's output or from an abundance-sum-to-one layer after a ReLU (non-negativity + ASC),
the spectral angle distance acos(<x, x_hat> / (|x| |x_hat|)) clamped to [-1, 1], the spectral
information divergence (a symmetric KL between the spectra normalised to sum to one), an L1/2
sparsity penalty on the abundances, per-band standardisation inside the model, and a 3-D CNN
classifying band x height x width patches. Scenes are synthetic: smooth positive endmember
spectra mixed by Dirichlet abundances, with the water-absorption bands at 0 in every pixel.
The factories live at module level so that ``nanreplay`` rebuilds them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

BANDS = 24
ENDMEMBERS = 4
WATER = [9, 10, 17]  # the water-absorption bands (~1400 and ~1900 nm): 0 in every pixel
CLASSES = 3


def endmember_library(g: torch.Generator) -> torch.Tensor:
    """(ENDMEMBERS, BANDS) smooth positive reflectance curves (a sum of Gaussian bumps)."""
    wl = torch.linspace(0, 1, BANDS)
    centres = torch.rand(ENDMEMBERS, 3, generator=g)
    heights = 0.2 + 0.6 * torch.rand(ENDMEMBERS, 3, generator=g)
    bumps = heights[..., None] * torch.exp(-((wl - centres[..., None]) / 0.2) ** 2)
    return 0.05 + bumps.sum(1)


def scene(g: torch.Generator, n: int, noise: float = 0.005):
    """``n`` mixed pixels (n, BANDS) and their abundances (n, ENDMEMBERS); the water bands
    are 0 (the sensor sees nothing through the atmosphere there)."""
    lib = endmember_library(torch.Generator().manual_seed(7))
    abund = torch._sample_dirichlet(torch.full((n, ENDMEMBERS), 0.7), generator=g)
    x = abund @ lib + noise * torch.randn(n, BANDS, generator=g)
    x = x.clamp_min(1e-3)
    x[:, WATER] = 0.0
    return x, abund


def pixel_loader(g: torch.Generator, n: int, batch: int) -> DataLoader:
    """A shuffling DataLoader over the scene's pixels (the loader draws from torch's RNG)."""
    x, abund = scene(g, n)
    return DataLoader(TensorDataset(x, abund), batch_size=batch, shuffle=True)


def patches(g: torch.Generator, n: int, side: int = 5):
    """``n`` patches (n, 1, BANDS, side, side) of a labelled scene and their centre labels:
    each class is a dominant endmember."""
    lib = endmember_library(torch.Generator().manual_seed(7))
    labels = torch.randint(0, CLASSES, (n,), generator=g)
    weights = torch.full((n, ENDMEMBERS), 0.1)
    weights[torch.arange(n), labels] = 1.0
    weights = weights / weights.sum(1, keepdim=True)
    spectra = weights @ lib  # (n, BANDS)
    cube = spectra[:, :, None, None] * (1 + 0.05 * torch.randn(n, BANDS, side, side, generator=g))
    cube[:, WATER] = 0.0
    return cube[:, None], labels


class SoftmaxAbundance(nn.Module):
    """Abundances as a softmax over the endmembers; ``sharpness`` scales the logits (the
    'sparse' unmixing nets' temperature)."""

    def __init__(self, sharpness: float = 1.0):
        super().__init__()
        self.sharpness = sharpness

    def forward(self, h):
        return torch.softmax(self.sharpness * h, dim=1)


class ASC(nn.Module):
    """Non-negativity (ReLU) then abundance-sum-to-one: a / sum(a)."""

    def forward(self, h):
        a = F.relu(h)
        return a / a.sum(1, keepdim=True)


class ExpAbundance(nn.Module):
    """Abundances as a softmax written out: exp(h / T) / sum exp(h / T)."""

    def __init__(self, temperature: float = 0.5):
        super().__init__()
        self.temperature = temperature

    def forward(self, h):
        e = torch.exp(h / self.temperature)
        return e / e.sum(1, keepdim=True)


class OnePassBandNorm(nn.Module):
    """Per-band standardisation with the one-pass variance E[x^2] - E[x]^2 (on radiance)."""

    def forward(self, x):
        mean = x.mean(0, keepdim=True)
        var = (x * x).mean(0, keepdim=True) - mean * mean
        return (x - mean) / torch.sqrt(var + 1e-6)


class BandNorm(nn.Module):
    """Per-band standardisation over the batch's pixels (x - mean) / std."""

    def forward(self, x):
        return (x - x.mean(0, keepdim=True)) / x.std(0, keepdim=True)


class UnmixingAE(nn.Module):
    """Pixel (B, BANDS) -> (reconstruction (B, BANDS), abundances (B, ENDMEMBERS)); the
    decoder's weight (BANDS, ENDMEMBERS) holds the endmembers."""

    def __init__(self, abundance: nn.Module, band_norm: nn.Module | None = None,
                 bias: bool = True, hidden: int = 32):
        super().__init__()
        self.norm = band_norm if band_norm is not None else nn.Identity()
        self.encoder = nn.Sequential(nn.Linear(BANDS, hidden, bias=bias), nn.LeakyReLU(0.1),
                                     nn.Linear(hidden, ENDMEMBERS, bias=bias))
        self.abundance = abundance
        self.decoder = nn.Linear(ENDMEMBERS, BANDS, bias=False)
        with torch.no_grad():  # endmembers initialised positive (as from VCA)
            self.decoder.weight.uniform_(0.1, 0.6)

    def forward(self, x):
        a = self.abundance(self.encoder(self.norm(x)))
        return self.decoder(a), a


class UnitEndmembers(nn.Module):
    """A decoder whose endmembers (the columns of ``weight``, BANDS x ENDMEMBERS) are scaled
    to unit norm in the forward: the abundances then carry the brightness."""

    def __init__(self, endmembers: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(endmembers.clone())

    def forward(self, a):
        e = self.weight / self.weight.norm(dim=0, keepdim=True)
        return a @ e.T


def make_vca_ae() -> nn.Module:
    """The autoencoder with endmembers initialised from an extraction (VCA) that found three
    of the four: the fourth column is left 0."""
    torch.manual_seed(0)
    model = UnmixingAE(SoftmaxAbundance())
    found = endmember_library(torch.Generator().manual_seed(7)).T.clone()
    found[:, 3] = 0.0
    model.decoder = UnitEndmembers(found)
    return model


def make_softmax_ae() -> nn.Module:
    torch.manual_seed(0)
    return UnmixingAE(SoftmaxAbundance())


def make_sharp_ae() -> nn.Module:
    torch.manual_seed(0)
    return UnmixingAE(SoftmaxAbundance(sharpness=5.0))


def make_asc_ae() -> nn.Module:
    """The ReLU + ASC autoencoder whose encoder has no biases (uDAS, EndNet-style)."""
    torch.manual_seed(0)
    return UnmixingAE(ASC(), bias=False)


def make_band_norm_ae() -> nn.Module:
    torch.manual_seed(0)
    return UnmixingAE(SoftmaxAbundance(), band_norm=BandNorm())


def make_radiance_ae() -> nn.Module:
    """The autoencoder on radiance DN, standardised per band in one pass."""
    torch.manual_seed(0)
    return UnmixingAE(SoftmaxAbundance(), band_norm=OnePassBandNorm())


def make_relu_asc_ae() -> nn.Module:
    torch.manual_seed(0)
    return UnmixingAE(ASC())


def make_exp_ae() -> nn.Module:
    torch.manual_seed(0)
    return UnmixingAE(ExpAbundance())


def sad(x_hat, x):
    """Spectral angle distance, mean over the pixels (clamped to acos's domain)."""
    cos = (x_hat * x).sum(-1) / (x_hat.norm(dim=-1) * x.norm(dim=-1))
    return torch.acos(cos.clamp(-1, 1)).mean()


def sad_safe(x_hat, x):
    """F.cosine_similarity (an eps on the norms) and a clamp inside acos's open domain."""
    cos = F.cosine_similarity(x_hat, x, dim=-1, eps=1e-8)
    return torch.acos(cos.clamp(-1 + 1e-6, 1 - 1e-6)).mean()


def sid(x_hat, x):
    """Spectral information divergence: KL(p||q) + KL(q||p) of the normalised spectra."""
    p = x / x.sum(-1, keepdim=True)
    q = x_hat / x_hat.sum(-1, keepdim=True)
    return (p * torch.log(p / q) + q * torch.log(q / p)).sum(-1).mean()


class UnmixingLoss(nn.Module):
    """SAD on the reconstruction + ``lam`` * L1/2 sparsity sum(sqrt(a)) of the abundances,
    the autoencoder's (x_hat, a) output as the first argument; ``mask`` drops bands (the
    water-absorption bands) from the reconstruction term."""

    def __init__(self, lam: float = 0.0, mse: float = 0.0, mask: torch.Tensor | None = None,
                 entropy: float = 0.0):
        super().__init__()
        self.lam, self.mse, self.entropy = lam, mse, entropy
        keep = torch.ones(BANDS) if mask is None else mask
        self.register_buffer("keep", keep)

    def forward(self, out, x):
        x_hat, a = out
        x_hat, x = x_hat * self.keep, x * self.keep
        loss = sad_safe(x_hat, x) + self.mse * F.mse_loss(x_hat, x)
        if self.lam:
            loss = loss + self.lam * a.sqrt().sum(1).mean()
        if self.entropy:  # pure pixels: low abundance entropy
            loss = loss - self.entropy * (a * torch.log(a)).sum(1).mean()
        return loss


def band_mask() -> torch.Tensor:
    keep = torch.ones(BANDS)
    keep[WATER] = 0.0
    return keep


class HSI3DCNN(nn.Module):
    """3-D CNN over (1, BANDS, h, w) patches -> class logits (Hamida et al. style)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv3d(1, 8, (7, 3, 3), padding=(0, 1, 1))
        self.conv2 = nn.Conv3d(8, 8, (5, 3, 3), stride=(2, 1, 1))
        self.pool = nn.AdaptiveAvgPool3d(1)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        return self.head(self.pool(x).flatten(1))


def make_cnn3d() -> nn.Module:
    torch.manual_seed(0)
    return HSI3DCNN()


def sad_loss(out, x):
    """SAD of the autoencoder's reconstruction (its (x_hat, a) output)."""
    return sad(out[0], x)


def sid_loss(out, x):
    return sid(out[0], x)
