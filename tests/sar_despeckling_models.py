"""SAR image despeckling as SAR-CNN / ID-CNN code writes it, for ``test_sar_despeckling``.

Intensity images ``(B, 1, H, W)`` carry multiplicative Gamma speckle of ``L`` looks
(``I = R * n``, ``n ~ Gamma(L, 1/L)``); a validity mask ``(B, 1, H, W)`` (0 on the no-data
border of a swath) is passed into ``forward``. ``LogDespeckler`` (SAR-CNN): the network works
on ``log(I + eps)`` and predicts the clean log-intensity as the noisy one minus the estimated
log-speckle. ``RatioDespeckler`` (ID-CNN): a ReLU head estimates the speckle ``n_hat`` and the
clean image is the ratio ``I / n_hat``. Losses: an MSE in the log domain, the Gamma negative
log-likelihood of the noisy intensity given the prediction (``lgamma(L)``, ``log`` of the
predicted intensity), and a total-variation regulariser ``sqrt(dx^2 + dy^2)``. Each image is
normalised by its 99th percentile (``torch.quantile``) before the network.
"""

from __future__ import annotations

import torch
from torch import nn

H = W = 16
LOOKS = 4


class Body(nn.Module):
    """The DnCNN-style trunk: conv, ReLU, conv."""

    def __init__(self, ch: int = 8):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(1, ch, 3, padding=1), nn.ReLU(),
                                 nn.Conv2d(ch, 1, 3, padding=1))

    def forward(self, x):
        return self.net(x)


def percentile_normalise(img, q: float = 0.99):
    """Divide each image by its ``q`` percentile (the usual SAR dynamic-range scaling)."""
    p = torch.quantile(img.flatten(1), q, dim=1)
    return img / (p[:, None, None, None] + 1e-6)


class LogDespeckler(nn.Module):
    """SAR-CNN: clean log-intensity = log(I + eps) - body(log(I + eps)), cut to the valid area."""

    def __init__(self, eps: float = 1e-3, normalise: bool = True):
        super().__init__()
        self.body = Body()
        self.eps = eps  # the bug at 0: log(0) on the no-data border is -inf
        self.normalise = normalise

    def forward(self, intensity, valid):
        x = percentile_normalise(intensity) if self.normalise else intensity
        z = torch.log(x + self.eps)
        return (z - self.body(z)) * valid


class RatioDespeckler(nn.Module):
    """ID-CNN: a ReLU head estimates the speckle, the clean image is ``I / n_hat``."""

    def __init__(self, head_bias: float = 1.0, normalise: bool = True, squash: bool = True):
        super().__init__()
        self.squash = squash
        self.body = Body()
        self.head = nn.ReLU()
        with torch.no_grad():
            self.body.net[2].bias.fill_(head_bias)
        self.normalise = normalise

    def forward(self, intensity, valid):
        x = percentile_normalise(intensity) if self.normalise else intensity
        n_hat = self.head(self.body(x))
        ratio = x / n_hat
        return (torch.tanh(ratio) if self.squash else ratio) * valid


class LogMSE(nn.Module):
    """MSE between the predicted and the clean log-intensity over the valid pixels."""

    def __init__(self, eps: float = 1e-3):
        super().__init__()
        self.eps = eps

    def forward(self, pred_log, clean, valid):
        target = torch.log(percentile_normalise(clean) + self.eps) * valid
        return ((pred_log - target) ** 2).sum() / valid.sum().clamp_min(1)


class GammaNLL(nn.Module):
    """The Gamma negative log-likelihood of the noisy intensity given the predicted one,
    ``L log(R) + L I / R - (L - 1) log(I) + lgamma(L) - L log(L)``, over the valid pixels."""

    def __init__(self, looks: float = LOOKS):
        super().__init__()
        self.looks = looks

    def forward(self, pred_log, noisy, valid):
        L = torch.as_tensor(float(self.looks))
        r = torch.exp(pred_log)
        i = percentile_normalise(noisy) + 1e-3
        nll = (L * torch.log(r) + L * i / r - (L - 1) * torch.log(i)
               + torch.lgamma(L) - L * torch.log(L))
        return (nll * valid).sum() / valid.sum().clamp_min(1)


class TVLoss(nn.Module):
    """A data term plus an isotropic total variation ``sqrt(dx^2 + dy^2)`` of the output."""

    def __init__(self, weight: float = 0.01, eps: float = 1e-6):
        super().__init__()
        self.data = LogMSE()
        self.weight = weight
        self.eps = eps  # the bug at 0: sqrt's gradient at 0 on flat areas is inf

    def forward(self, pred_log, clean, valid):
        dx = pred_log[..., 1:, :-1] - pred_log[..., :-1, :-1]
        dy = pred_log[..., :-1, 1:] - pred_log[..., :-1, :-1]
        tv = torch.sqrt(dx ** 2 + dy ** 2 + self.eps).mean()
        return self.data(pred_log, clean, valid) + self.weight * tv


def scenes(n: int = 32, nodata: int | None = None, nan_at: int | None = None,
           raw: int | None = None, looks: int = LOOKS):
    """Synthetic SAR scenes: (noisy intensity, validity mask) and the clean reflectivity.

    ``nodata``: that scene lies at the swath edge, its left 5 columns no-data (0 in the
    intensity, 0 in the mask); ``nan_at``: that scene's GeoTIFF holds NaN no-data pixels;
    ``raw``: that scene is in raw linear units (x 1e6), not calibrated sigma0."""
    g = torch.Generator().manual_seed(5)
    yy, xx = torch.meshgrid(torch.arange(H), torch.arange(W), indexing="ij")
    base = 0.2 + 0.8 * (torch.sin(xx[None] / 3.0 + torch.rand(n, 1, 1, generator=g) * 6) > 0)
    clean = (base * (0.5 + torch.rand(n, 1, 1, generator=g)))[:, None].float()
    speckle = torch._standard_gamma(torch.full((n, 1, H, W), float(looks)), generator=g) / looks
    noisy = clean * speckle
    valid = torch.ones(n, 1, H, W)
    if nodata is not None:
        noisy[nodata, :, :, :5] = 0
        clean[nodata, :, :, :5] = 0
        valid[nodata, :, :, :5] = 0
    if nan_at is not None:
        noisy[nan_at, 0, 2:4, 0] = float("nan")
    if raw is not None:
        noisy[raw] *= 1e6
    return torch.utils.data.TensorDataset(noisy, valid, clean)


def make_log():
    torch.manual_seed(0)
    return LogDespeckler()


def make_log_no_eps():
    torch.manual_seed(0)
    return LogDespeckler(eps=0.0)


def make_log_raw():
    torch.manual_seed(0)
    return LogDespeckler(normalise=False)


def make_ratio():
    torch.manual_seed(0)
    return RatioDespeckler()


def make_ratio_dead():
    torch.manual_seed(0)
    return RatioDespeckler(head_bias=-5.0, squash=False)


def make_ratio_raw():
    torch.manual_seed(0)
    return RatioDespeckler(normalise=False)
