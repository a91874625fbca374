"""Losses built from metric libraries, as restoration, compression, super-resolution and
forecasting code writes them: torchmetrics' functional MS-SSIM, PSNR, RMSE, Pearson, KL
divergence and total variation inside user-defined loss modules, pytorch-msssim's ``SSIM``
module as ``1 - ssim``, a perceptual feature loss over a small CNN, and the models and data
they train (a residual restorer, a persistence-residual forecaster, a histogram predictor).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pytorch_msssim import SSIM
from torch import nn
from torchmetrics.functional import kl_divergence, mean_squared_error, pearson_corrcoef
from torchmetrics.functional.image import (
    multiscale_structural_similarity_index_measure,
    peak_signal_noise_ratio,
    total_variation,
)
from torchmetrics.image import MultiScaleStructuralSimilarityIndexMeasure

# --- models ---------------------------------------------------------------------------------


class Restorer(nn.Module):
    """A residual denoiser: ``x + body(x)``, its last conv zero-initialised (the identity at
    initialisation, as NAFNet and EDSR's residual scaling start); ``tanh=True`` ends it with a
    ``tanh`` instead (images in [-1, 1], the GAN convention)."""

    def __init__(self, ch: int = 3, width: int = 8, tanh: bool = False, scale: float = 0.0):
        super().__init__()
        self.scale = scale
        self.head = nn.Conv2d(ch, width, 3, padding=1)
        self.act = nn.ReLU()
        self.tail = nn.Conv2d(width, ch, 3, padding=1)
        self.tanh = tanh
        if not tanh and not scale:
            nn.init.zeros_(self.tail.weight)
            nn.init.zeros_(self.tail.bias)

    def forward(self, x):
        y = self.tail(self.act(self.head(x)))
        if self.scale:  # a net predicting 8-bit intensities: its output denormalised
            return y * self.scale
        return torch.tanh(y) if self.tanh else x + y


def make_restorer():
    torch.manual_seed(0)
    return Restorer()


def make_tanh_restorer():
    torch.manual_seed(0)
    return Restorer(tanh=True)


class Forecaster(nn.Module):
    """A persistence-residual forecaster: the last observed value repeated over the horizon plus
    an MLP's correction, the correction's last layer zero-initialised (N-BEATS-style naive
    start)."""

    def __init__(self, window: int = 12, horizon: int = 6, hidden: int = 16):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(window, hidden), nn.ReLU())
        self.out = nn.Linear(hidden, horizon)
        self.horizon = horizon
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, x):
        last = x[:, -1:].expand(-1, self.horizon)
        return last + self.out(self.mlp(x))


def make_255_restorer():
    torch.manual_seed(0)
    return Restorer(scale=255.0)


def make_forecaster():
    torch.manual_seed(0)
    return Forecaster()


class HistogramNet(nn.Module):
    """Predicts a distribution over ``bins`` (a colour histogram, a quantised value) as a softmax
    of logits divided by a temperature (sharpened: ``temperature < 1``)."""

    def __init__(self, features: int = 8, bins: int = 10, temperature: float = 1.0):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(features, 16), nn.ReLU(), nn.Linear(16, bins))
        self.temperature = temperature

    def forward(self, x):
        return torch.softmax(self.body(x) / self.temperature, dim=-1)


def make_histogram_net():
    torch.manual_seed(0)
    return HistogramNet()


class RectifiedHistogramNet(HistogramNet):
    """Predicts a histogram as rectified scores normalised to sum 1 (non-negative, as an NMF
    decoder's or a count model's intensities), not a softmax: a bin can be exactly 0."""

    def forward(self, x):
        s = F.relu(self.body(x))
        return s / s.sum(-1, keepdim=True)


def make_rectified_histogram_net():
    torch.manual_seed(0)
    return RectifiedHistogramNet()


def make_sharp_histogram_net():
    torch.manual_seed(0)
    return HistogramNet(temperature=0.005)


class FeatureNet(nn.Module):
    """A small frozen CNN whose activations a perceptual loss compares (a VGG stand-in)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, stride=2)
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(self, x):
        f1 = F.relu(self.conv1(x))
        return [f1, F.relu(self.conv2(f1))]


# --- losses ----------------------------------------------------------------------------------


class MSSSIMLoss(nn.Module):
    """``1 - MS-SSIM`` through torchmetrics' functional form, three scales for small patches;
    ``normalize=None`` is the paper's formula (``cs ** beta`` per scale, no ``relu``)."""

    def __init__(self, data_range: float = 1.0, normalize: str | None = "relu"):
        super().__init__()
        self.data_range = data_range
        self.normalize = normalize

    def forward(self, pred, target):
        ms = multiscale_structural_similarity_index_measure(
            pred, target, data_range=self.data_range, kernel_size=5, sigma=0.8,
            betas=(0.2, 0.3, 0.5), normalize=self.normalize)
        return 1 - ms


class MixLoss(nn.Module):
    """Zhao et al.'s mix: ``alpha * (1 - MS-SSIM) + (1 - alpha) * L1``."""

    def __init__(self, alpha: float = 0.84, data_range: float = 1.0, normalize="relu"):
        super().__init__()
        self.alpha = alpha
        self.ms_ssim = MSSSIMLoss(data_range, normalize)

    def forward(self, pred, target):
        return self.alpha * self.ms_ssim(pred, target) + (1 - self.alpha) * F.l1_loss(pred, target)


class MetricMixLoss(nn.Module):
    """The same mix through torchmetrics' ``MultiScaleStructuralSimilarityIndexMeasure`` metric
    object (a module with states, updated by each call; its ``forward`` returns the batch's
    value), which also reports the epoch's running MS-SSIM through ``compute()``."""

    def __init__(self, alpha: float = 0.84, normalize="relu"):
        super().__init__()
        self.alpha = alpha
        self.ms_ssim = MultiScaleStructuralSimilarityIndexMeasure(
            data_range=1.0, kernel_size=5, sigma=0.8, betas=(0.2, 0.3, 0.5), normalize=normalize)

    def forward(self, pred, target):
        ms = self.ms_ssim(pred, target)
        return self.alpha * (1 - ms) + (1 - self.alpha) * F.l1_loss(pred, target)


class PSNRLoss(nn.Module):
    """``-PSNR`` of each image as the loss (torchmetrics' ``peak_signal_noise_ratio`` over
    ``dim=(1, 2, 3)``, one value per image, averaged)."""

    def forward(self, pred, target):
        psnr = peak_signal_noise_ratio(pred, target, data_range=1.0, dim=(1, 2, 3),
                                       reduction="none")
        return -psnr.mean()


class RMSELoss(nn.Module):
    """The mean over series of each series' RMSE (torchmetrics' ``mean_squared_error`` with
    ``squared=False``), so that every series weighs the same whatever its scale."""

    def forward(self, pred, target):
        per_series = [mean_squared_error(p, t, squared=False) for p, t in zip(pred, target)]
        return torch.stack(per_series).mean()


class CorrLoss(nn.Module):
    """``1 - Pearson`` of each series' forecast with its truth over the horizon, plus MSE (a
    shape-and-level forecasting loss): ``pearson_corrcoef`` of ``(H, B)``, one column a series."""

    def forward(self, pred, target):
        r = pearson_corrcoef(pred.T, target.T)
        return (1 - r).mean() + F.mse_loss(pred, target)


class HistKLLoss(nn.Module):
    """``KL(target || predicted)`` of histograms through torchmetrics' ``kl_divergence``."""

    def forward(self, pred, target):
        return kl_divergence(target, pred)


class TVRestorationLoss(nn.Module):
    """L1 plus a total-variation prior on the output (torchmetrics' ``total_variation``, summed
    over each image), weighted per pixel."""

    def __init__(self, weight: float = 1e-4):
        super().__init__()
        self.weight = weight

    def forward(self, pred, target):
        tv = total_variation(pred, reduction="mean") / pred[0].numel()
        return F.l1_loss(pred, target) + self.weight * tv


class PerceptualSSIMLoss(nn.Module):
    """L1 + ``(1 - SSIM)`` (pytorch-msssim's module) + a perceptual feature L1 over a frozen
    CNN's activations."""

    def __init__(self):
        super().__init__()
        self.ssim = SSIM(data_range=1.0, win_size=3, channel=3)
        self.features = FeatureNet()

    def forward(self, pred, target):
        perc = sum(F.l1_loss(a, b) for a, b in zip(self.features(pred), self.features(target)))
        return F.l1_loss(pred, target) + 0.5 * (1 - self.ssim(pred, target)) + 0.1 * perc


# --- data ------------------------------------------------------------------------------------


class Pairs(torch.utils.data.Dataset):
    """Paired (degraded, clean) patches."""

    def __init__(self, lq, gt):
        self.lq, self.gt = lq, gt

    def __len__(self):
        return len(self.lq)

    def __getitem__(self, i):
        return self.lq[i], self.gt[i]


def noisy_patches(n: int = 8, size: int = 16, sigma: float = 0.05, clean_at=(), scale=1.0):
    """Clean smooth patches in [0, 1] (times ``scale``) and their noisy copies; the patches in
    ``clean_at`` drew no noise (their degraded patch is the clean one)."""
    g = torch.Generator().manual_seed(0)
    yy, xx = torch.meshgrid(torch.linspace(0, 1, size), torch.linspace(0, 1, size), indexing="ij")
    phase = torch.rand(n, 3, 1, 1, generator=g) * 6
    clean = 0.5 + 0.4 * torch.sin(3 * xx + 2 * yy + phase)
    noise = sigma * torch.randn(n, 3, size, size, generator=g)
    for i in clean_at:
        noise[i] = 0
    noisy = (clean + noise).clamp(0, 1)
    return noisy * scale, clean * scale


def series_windows(n: int = 8, window: int = 12, horizon: int = 6, flat_at=()):
    """Sine series cut into (window, horizon) pairs; the series in ``flat_at`` are flat (a sensor
    stuck at its last value)."""
    g = torch.Generator().manual_seed(0)
    t = torch.arange(window + horizon, dtype=torch.float32)
    phase = torch.rand(n, 1, generator=g) * 6
    s = torch.sin(0.5 * t + phase) + 0.1 * torch.randn(n, window + horizon, generator=g)
    for i in flat_at:
        s[i] = 0.3
    return s[:, :window], s[:, window:]


def histograms(n: int = 8, features: int = 8, bins: int = 10):
    """Features and the smoothed histograms a model learns to predict from them (every bin > 0)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, features, generator=g)
    h = torch.softmax(torch.randn(n, bins, generator=g), dim=-1)
    return x, h
