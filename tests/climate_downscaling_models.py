"""Statistical downscaling of climate model output as DeepSD / CNN-BG / Harder et al. write it,
for ``test_climate_downscaling``.

- ``DownscaleNet``: coarse reanalysis fields ``(B, C, 4, 4)`` -> fine ``(B, 2, 16, 16)``
  precipitation and temperature: a conv encoder, nearest upsampling by 4, the land-sea mask
  concatenated in ``forward``, a conv decoder, a learned land bias, and a mass-conserving
  precipitation output (``MassConserve``: each fine cell rescaled so the block's mean equals
  its coarse cell; fine precipitation is zeroed where the coarse cell is dry).
- ``BernoulliGammaNet``: the same trunk with a Bernoulli-Gamma head (rain probability, Gamma
  shape and scale, softplus-positive; or the scale through ``exp``), trained with
  ``BernoulliGammaLoss`` (``lgamma``, logs of shape and scale) or the Gamma density written out
  (``gamma_pdf_loss``).
- ``FieldNorm``: per-sample, per-channel standardisation of the first conv's output with the
  variance as ``E[x^2] - E[x]^2`` (one pass over the field).
- ``lat_weighted_mse``: MSE of ``log1p`` precipitation and standardised temperature weighted by
  ``cos(lat)``.
- ``climate_batch``/``ClimateSlices``: synthetic coarse and fine fields in physical units
  (mm/day, K, hPa), standardised per variable with a climatological mean and std.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FACTOR, COARSE, B, T = 4, 4, 8, 2
FINE = COARSE * FACTOR
LAT = torch.linspace(30.0, 60.0, FINE)  # the fine grid's latitudes (degrees north)
# Climatological (mean, std) per input variable: precipitation (mm/day), 2 m temperature (K),
# surface pressure (hPa), snow cover fraction (0 over this domain's training years).
CLIM = torch.tensor([[3.0, 4.0], [285.0, 8.0], [1013.0, 10.0], [0.0, 0.0]])
CLIM_STD_FLOOR = torch.tensor([[3.0, 4.0], [285.0, 8.0], [1013.0, 10.0], [0.0, 1.0]])


class MassConserve(nn.Module):
    """Harder et al.'s multiplicative constraint: ``y * x / mean_block(y)``."""

    def __init__(self, eps: float = 1e-6, where: bool = False):
        super().__init__()
        self.eps, self.where = eps, where

    def forward(self, fine, coarse_pr):
        coarse_up = F.interpolate(coarse_pr, scale_factor=FACTOR, mode="nearest")
        fine = fine * (coarse_up > 0)  # no rain where the coarse cell is dry
        block_mean = F.interpolate(F.avg_pool2d(fine, FACTOR), scale_factor=FACTOR)
        if self.where:  # (dry blocks set to 0 after the division)
            return torch.where(block_mean > 0, fine * coarse_up / block_mean, 0.0)
        return fine * coarse_up / (block_mean + self.eps)


class FieldNorm(nn.Module):
    """Standardise each sample's channel over the field, variance in one pass."""

    def forward(self, h):
        mean = h.mean((2, 3), keepdim=True)
        var = (h * h).mean((2, 3), keepdim=True) - mean * mean
        return (h - mean) / torch.sqrt(var + 1e-5)


class Trunk(nn.Module):
    def __init__(self, c_in: int = 4, hidden: int = 8, norm: bool = False):
        super().__init__()
        self.enc = nn.Conv2d(c_in, hidden, 3, padding=1, padding_mode="replicate")
        self.norm = FieldNorm() if norm else nn.Identity()
        self.up = nn.Upsample(scale_factor=FACTOR, mode="nearest")
        self.dec = nn.Conv2d(hidden + 1, hidden, 3, padding=1)
        self.land_bias = nn.Parameter(torch.zeros(1, hidden, 1, 1))

    def forward(self, x, landsea):
        h = F.relu(self.norm(self.enc(x)))
        h = self.dec(torch.cat([self.up(h), landsea], 1))
        return F.relu(h + landsea * self.land_bias)  # (orography-like land adjustment)


class DownscaleNet(nn.Module):
    def __init__(self, eps: float = 1e-6, norm: bool = False, where: bool = False):
        super().__init__()
        self.trunk = Trunk(norm=norm)
        self.out = nn.Conv2d(8, 2, 1)
        self.conserve = MassConserve(eps, where)

    def forward(self, x, coarse_pr, landsea):
        y = self.out(self.trunk(x, landsea))
        pr = self.conserve(F.softplus(y[:, :1]), coarse_pr)
        return torch.cat([pr, y[:, 1:]], 1)


def make_downscale() -> DownscaleNet:
    torch.manual_seed(0)
    return DownscaleNet()


def make_downscale_noeps() -> DownscaleNet:
    torch.manual_seed(0)
    return DownscaleNet(eps=0.0)


def make_downscale_where() -> DownscaleNet:
    torch.manual_seed(0)
    return DownscaleNet(where=True)


def make_downscale_norm() -> DownscaleNet:
    torch.manual_seed(0)
    return DownscaleNet(norm=True)


class BernoulliGammaHead(nn.Module):
    def __init__(self, hidden: int = 8, exp_scale: bool = False):
        super().__init__()
        self.conv = nn.Conv2d(hidden, 3, 1)
        self.exp_scale = exp_scale

    def forward(self, h):
        logit, a, b = self.conv(h).unbind(1)
        p = torch.sigmoid(logit)
        alpha = F.softplus(a) + 1e-3
        beta = torch.exp(b) if self.exp_scale else F.softplus(b) + 1e-3
        return torch.stack([p, alpha, beta], 1)


class BernoulliGammaNet(nn.Module):
    def __init__(self, exp_scale: bool = False):
        super().__init__()
        self.trunk = Trunk()
        self.head = BernoulliGammaHead(exp_scale=exp_scale)

    def forward(self, x, landsea):
        return self.head(self.trunk(x, landsea))


def make_bgamma() -> BernoulliGammaNet:
    torch.manual_seed(0)
    return BernoulliGammaNet()


def make_bgamma_exp() -> BernoulliGammaNet:
    torch.manual_seed(0)
    return BernoulliGammaNet(exp_scale=True)


class BernoulliGammaLoss(nn.Module):
    """Negative log-likelihood of a Bernoulli-Gamma: ``-log(1-p)`` on dry cells, and on wet
    cells ``-log p - (a-1) log y + y/b + a log b + lgamma(a)``; ``where`` picks the branch."""

    def __init__(self, wet_threshold: float = 0.0):
        super().__init__()
        self.wet_threshold = wet_threshold

    def forward(self, out, y):
        p, alpha, beta = out.unbind(1)
        y = y[:, 0]
        wet = y > self.wet_threshold
        wet_nll = (-torch.log(p) - (alpha - 1) * torch.log(y) + y / beta
                   + alpha * torch.log(beta) + torch.lgamma(alpha))
        dry_nll = -torch.log(1 - p)
        return torch.where(wet, wet_nll, dry_nll).mean()


class SafeBernoulliGammaLoss(BernoulliGammaLoss):
    """The same likelihood with the log of the rain amounts taken on a filled copy."""

    def forward(self, out, y):
        p, alpha, beta = out.unbind(1)
        y = y[:, 0]
        wet = y > self.wet_threshold
        y_wet = torch.where(wet, y, torch.ones_like(y))
        wet_nll = (-torch.log(p) - (alpha - 1) * torch.log(y_wet) + y_wet / beta
                   + alpha * torch.log(beta) + torch.lgamma(alpha))
        dry_nll = -torch.log(1 - p)
        return torch.where(wet, wet_nll, dry_nll).mean()


def gamma_pdf_loss(out, y):
    """The Bernoulli-Gamma likelihood with the Gamma density written out, then logged."""
    p, alpha, beta = out.unbind(1)
    y = y[:, 0]
    wet = y > 0
    y_wet = torch.where(wet, y, torch.ones_like(y))
    pdf = y_wet ** (alpha - 1) * torch.exp(-y_wet / beta) / (beta ** alpha
                                                             * torch.exp(torch.lgamma(alpha)))
    lik = torch.where(wet, p * pdf, 1 - p)
    return -torch.log(lik).mean()


COS_LAT = torch.cos(torch.deg2rad(LAT))
LAT_W = (COS_LAT / COS_LAT.mean())[:, None]  # (FINE, 1): rows are latitudes


def lat_weighted_mse(pred, y):
    """``cos(lat)``-weighted MSE of ``log1p`` precipitation and standardised temperature."""
    pr = (torch.log1p(pred[:, 0]) - torch.log1p(y[:, 0])) ** 2
    tas = (pred[:, 1] - (y[:, 1] - CLIM[1, 0]) / CLIM[1, 1]) ** 2
    return ((pr + tas) * LAT_W).mean()


def standardise(raw, clim=CLIM):
    """Per-variable standardisation with the climatological mean and std."""
    return (raw - clim[:, 0, None, None]) / clim[:, 1, None, None]


def climate_batch(g: torch.Generator, n: int = B, *, dry: int | None = None,
                  kelvin_raw: bool = False, pascal: int | None = None,
                  cyclone: int | None = None, cyclone_mm: float = 900.0, ocean: int | None = None, floor_std: bool = True):
    """(x, coarse precipitation, land-sea mask, fine targets) of one time slice.

    ``dry``: that sample's coarse cell (1, 2) has no rain; ``pascal``: that sample's pressure
    file in Pa; ``cyclone``: ``cyclone_mm`` in one fine cell of that sample; ``ocean``: that
    sample's tile all sea; ``floor_std``: the snow cover's std of 0 floored at 1 (else divided by it);
    ``kelvin_raw``: temperature fed unstandardised (left to the network's FieldNorm)."""
    pr = torch.distributions.Gamma(2.0, 0.7).sample((n, 1, COARSE, COARSE)) + 0.1
    if dry is not None:
        pr[dry, 0, 1, 2] = 0.0
    tas = (285 + 8 * torch.randn(n, 1, 1, 1, generator=g)
           + torch.randn(n, 1, COARSE, COARSE, generator=g))
    ps = 1013 + 10 * torch.randn(n, 1, COARSE, COARSE, generator=g)
    if pascal is not None:
        ps[pascal] *= 100
    snow = torch.zeros(n, 1, COARSE, COARSE)
    raw = torch.cat([pr, tas, ps, snow], 1)
    x = standardise(raw, CLIM_STD_FLOOR if floor_std else CLIM)
    if kelvin_raw:
        x[:, 1] = raw[:, 1]
    land = (torch.rand(n, 1, FINE, FINE, generator=g) > 0.4).float()
    if ocean is not None:
        land[ocean] = 0.0
    up = F.interpolate(pr, scale_factor=FACTOR)
    wet = torch.rand(n, 1, FINE, FINE, generator=g) > 0.3
    fine_pr = up * (0.5 + torch.rand(n, 1, FINE, FINE, generator=g)) * wet * (up > 0)
    if cyclone is not None:
        fine_pr[cyclone, 0, 5, 7] = cyclone_mm
    fine_tas = F.interpolate(tas, scale_factor=FACTOR) + torch.randn(n, 1, FINE, FINE,
                                                                     generator=g)
    return x, pr, land, torch.cat([fine_pr, fine_tas], 1)


class ClimateSlices(torch.utils.data.Dataset):
    """Daily samples of ``T`` consecutive time slices each (for accumulation over slices)."""

    def __init__(self, n: int = 16, **bad):
        g = torch.Generator().manual_seed(3)
        torch.manual_seed(3)  # (the gamma draws)
        slices = [climate_batch(g, n, **bad) for _ in range(T)]
        self.items = [torch.stack([s[k] for s in slices]) for k in range(4)]  # (T, n, ...)

    def __len__(self):
        return self.items[0].shape[1]

    def __getitem__(self, i):
        return tuple(part[:, i] for part in self.items)


class BoxCoxMSE(nn.Module):
    """MSE of the precipitation in Box-Cox space, ``(y^lam - 1) / lam``, and temperature."""

    def __init__(self, lam: float = 0.25):
        super().__init__()
        self.lam = lam

    def forward(self, pred, y):
        target = (y[:, 0] ** self.lam - 1) / self.lam
        pr = (pred[:, 0] ** self.lam - 1) / self.lam
        tas = (pred[:, 1] - (y[:, 1] - CLIM[1, 0]) / CLIM[1, 1]) ** 2
        return (((pr - target) ** 2 + tas) * LAT_W).mean()


def land_mse(pred, y, land):
    """Each tile's MSE over its land cells (the station-based targets exist on land only)."""
    err = (torch.log1p(pred[:, :1]) - torch.log1p(y[:, :1])) ** 2 * land
    return (err.sum((1, 2, 3)) / land.sum((1, 2, 3))).mean()


class GlobalLatMSE(nn.Module):
    """Latitude-weighted MSE on a global grid whose rows run pole to pole, the weights'
    square root applied to the errors (``(sqrt(w) * err) ** 2``, as a weighted RMSE does)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("lat", torch.linspace(-90.0, 90.0, FINE))

    def forward(self, pred, y):
        w = torch.cos(torch.deg2rad(self.lat))
        w = torch.sqrt(w / w.mean())[:, None]
        err = torch.log1p(pred[:, 0]) - torch.log1p(y[:, 0])
        return ((w * err) ** 2).mean()
