"""Forecasting models and losses for ``test_timeseries``, written as the well-known repositories
write them (GluonTS's DeepAR heads, RevIN/PatchTST, N-BEATS and its losses), at module level
so that ``nanreplay`` rebuilds them from the bundle (``timeseries_models:make_deepar_nb``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import (AffineTransform, LogNormal, NegativeBinomial, Normal, StudentT,
                                 TransformedDistribution)


class DeepARNB(nn.Module):
    """GluonTS's DeepAR over counts: the context is divided by its mean absolute value (the
    ``MeanScaler``), an LSTM reads the lagged, scaled targets (teacher forcing), and the head
    maps to a negative binomial's ``mu = softplus(.) * scale`` and ``alpha = softplus(.)``, as
    ``NegativeBinomialOutput`` does (``total_count = 1 / alpha``, ``logits = log(mu * alpha)``).
    ``min_scale`` is the scaler's floor (GluonTS: 1e-10); 0 leaves it out."""

    def __init__(self, hidden: int = 16, min_scale: float = 1e-10, likelihood: str = "nb",
                 observed_by_product: bool = False):
        super().__init__()
        self.min_scale, self.likelihood = min_scale, likelihood
        self.observed_by_product = observed_by_product
        self.rnn = nn.LSTM(2, hidden, batch_first=True)
        self.proj = nn.Linear(hidden, 3)

    def forward(self, past, covariate):  # (B, T) counts, (B, T) covariate
        if self.observed_by_product:  # missing readings (NaN) weighted out by the mask
            observed = ~torch.isnan(past)
            scale = (past.abs() * observed).sum(1, keepdim=True) \
                / observed.sum(1, keepdim=True).clamp_min(1)
            past = torch.nan_to_num(past)
        else:
            scale = past.abs().mean(1, keepdim=True)
        if self.min_scale:
            scale = scale.clamp_min(self.min_scale)
        h, _ = self.rnn(torch.stack([past / scale, covariate], -1))
        a, b, c = self.proj(h).unbind(-1)
        if self.likelihood == "lognormal":  # positive demand: LogNormal(mu, sigma) of the scaled
            return LogNormal(a + torch.log(scale), F.softplus(b))
        if self.likelihood == "affine":  # GluonTS's scaled output: AffineTransformed(base, 0, scale)
            base = StudentT(2.0 + F.softplus(c), a, F.softplus(b))
            return TransformedDistribution(base, [AffineTransform(0.0, scale)])
        if self.likelihood == "studentt":
            return StudentT(2.0 + F.softplus(c), a * scale, F.softplus(b) * scale)
        mu, alpha = F.softplus(a) * scale, F.softplus(b)
        return NegativeBinomial(total_count=1.0 / alpha, logits=torch.log(mu * alpha))


def make_deepar_nb(**kw) -> nn.Module:
    torch.manual_seed(0)
    return DeepARNB(**kw)


def nll(dist, y):
    return -dist.log_prob(y).mean()


class RevIN(nn.Module):
    """RevIN as the official repository (and PatchTST's) writes it: ``norm`` keeps the
    series' mean and std as attributes and standardises, ``denorm`` undoes it on the
    forecast; the affine weight is divided out with ``eps * eps`` beside it."""

    def __init__(self, channels: int, eps: float = 1e-5, affine: bool = True):
        super().__init__()
        self.eps, self.affine = eps, affine
        if affine:
            self.affine_weight = nn.Parameter(torch.ones(channels))
            self.affine_bias = nn.Parameter(torch.zeros(channels))

    def forward(self, x, mode: str):
        if mode == "norm":
            self.mean = torch.mean(x, dim=1, keepdim=True).detach()
            self.stdev = torch.sqrt(torch.var(x, dim=1, keepdim=True, unbiased=False)
                                    + self.eps).detach()
            x = (x - self.mean) / self.stdev
            return x * self.affine_weight + self.affine_bias if self.affine else x
        if self.affine:
            x = (x - self.affine_bias) / (self.affine_weight + self.eps * self.eps)
        return x * self.stdev + self.mean


class PatchNorm(nn.Module):
    """Each patch standardised by its own mean and std (no eps): a flat patch is 0/0."""

    def forward(self, p):  # (B * C, patches, patch length)
        return (p - p.mean(-1, keepdim=True)) / p.std(-1, keepdim=True)


class PatchTST(nn.Module):
    """A channel-independent PatchTST: RevIN, patches of ``patch`` steps embedded and run
    through a Transformer encoder, a flatten head to the horizon, RevIN's denorm."""

    def __init__(self, channels=2, context=32, horizon=8, patch=8, d=16, eps=1e-5,
                 patch_norm=False):
        super().__init__()
        self.patch, self.n = patch, context // patch
        self.patch_norm = PatchNorm() if patch_norm else nn.Identity()
        self.revin = RevIN(channels, eps=eps)
        self.embed = nn.Linear(patch, d)
        self.pos = nn.Parameter(torch.randn(self.n, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(self.n * d, horizon)

    def forward(self, x):  # (B, L, C)
        B, _, C = x.shape
        z = self.revin(x, "norm").permute(0, 2, 1).reshape(B * C, self.n, self.patch)
        z = self.encoder(self.embed(self.patch_norm(z)) + self.pos)
        y = self.head(z.flatten(1)).reshape(B, C, -1).permute(0, 2, 1)
        return self.revin(y, "denorm")


def make_patchtst(**kw) -> nn.Module:
    torch.manual_seed(0)
    return PatchTST(**kw)


class NBeatsBlock(nn.Module):
    def __init__(self, context, horizon, width=32):
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(context, width), nn.ReLU(), nn.Linear(width, width),
                                nn.ReLU())
        self.theta = nn.Linear(width, context + horizon)
        self.context = context

    def forward(self, x):
        theta = self.theta(self.fc(x))
        return theta[:, :self.context], theta[:, self.context:]


class NBeats(nn.Module):
    """Generic N-BEATS: doubly residual blocks (backcast subtracted, forecasts summed); a
    demand forecaster clips the forecast at 0 (``relu``: sales are never negative)."""

    def __init__(self, context=24, horizon=6, blocks=3, nonnegative=True):
        super().__init__()
        self.blocks = nn.ModuleList(NBeatsBlock(context, horizon) for _ in range(blocks))
        self.nonnegative = nonnegative

    def forward(self, x):
        residual, forecast = x.flip(1), 0.0
        for block in self.blocks:
            backcast, f = block(residual)
            residual, forecast = residual - backcast, forecast + f
        return F.relu(forecast) if self.nonnegative else forecast


def make_nbeats(**kw) -> nn.Module:
    torch.manual_seed(0)
    return NBeats(**kw)


def divide_no_nan(a, b):
    """N-BEATS's (ElementAI's ``common/torch/losses.py``): a / b, with NaN and +inf set to 0."""
    result = a / b
    result[result != result] = .0
    result[result == float("inf")] = .0
    return result


def smape_2_loss(forecast, target, mask):
    """N-BEATS's sMAPE, without its ``.data`` on the denominator's forecast."""
    return 200 * torch.mean(divide_no_nan(torch.abs(forecast - target),
                                          torch.abs(forecast) + torch.abs(target)) * mask)


def mape_loss(forecast, target):
    return torch.mean(torch.abs((forecast - target) / target))


def mase_loss(insample, freq, forecast, target, mask):
    """N-BEATS's MASE: scaled by the in-sample seasonal naive error (0 for a flat context)."""
    masep = torch.mean(torch.abs(insample[:, freq:] - insample[:, :-freq]), dim=1)
    masked_masep_inv = divide_no_nan(mask, masep[:, None])
    return torch.mean(torch.abs(target - forecast) * masked_masep_inv)


def gaussian_nll(dist: Normal, y):
    return -dist.log_prob(y).mean()


def masked_nll(dist, y):
    """GluonTS's masked likelihood loss: missing targets (NaN) are left out of the mean."""
    observed = ~torch.isnan(y)
    return -(dist.log_prob(torch.nan_to_num(y)) * observed).sum() / observed.sum()


def masked_nll_by_zero(dist, y):
    """The same, masking the missing targets by multiplying their NaN log-likelihood by 0."""
    observed = ~torch.isnan(y)
    return -(dist.log_prob(y) * observed).sum() / observed.sum()


def masked_mse(forecast, target):
    """A point forecast's MSE over the observed targets, the missing ones (NaN) weighted out
    by multiplying with the mask."""
    observed = ~torch.isnan(target)
    return ((forecast - target) ** 2 * observed).sum() / observed.sum()


def weighted_average(x, weights, dim=None):
    """GluonTS's ``weighted_average``: the mean of ``x`` where ``weights`` is nonzero."""
    weighted = torch.where(weights != 0, x * weights, torch.zeros_like(x))
    total = torch.clamp(weights.sum(dim=dim) if dim is not None else weights.sum(), min=1.0)
    return (weighted.sum(dim=dim) if dim is not None else weighted.sum()) / total


def observed_nll(dist, y):
    """DeepAR's loss over the observed targets, weighted by GluonTS's ``weighted_average``."""
    return weighted_average(-dist.log_prob(y), (~torch.isnan(y)).float())


class PackedLSTMForecaster(nn.Module):
    """Series of different lengths, padded, each standardised over its own observed steps (an
    unbiased std: ``n - 1``), then read by an LSTM over the packed sequence; the last hidden
    state forecasts the next ``horizon`` values, de-standardised."""

    def __init__(self, hidden: int = 16, horizon: int = 4):
        super().__init__()
        self.lstm = nn.LSTM(1, hidden, batch_first=True)
        self.head = nn.Linear(hidden, horizon)

    def forward(self, x, lengths):  # (B, T) padded with 0, (B,) on the CPU
        valid = torch.arange(x.shape[1])[None, :] < lengths[:, None]
        n = lengths[:, None].to(x.dtype)
        mean = x.sum(1, keepdim=True) / n
        std = torch.sqrt(((x - mean) ** 2 * valid).sum(1, keepdim=True) / (n - 1))
        z = ((x - mean) / std * valid).unsqueeze(-1)
        packed = nn.utils.rnn.pack_padded_sequence(z, lengths, batch_first=True,
                                                   enforce_sorted=False)
        _, (h, _) = self.lstm(packed)
        return self.head(h[-1]) * std + mean


def make_packed_lstm(**kw) -> nn.Module:
    torch.manual_seed(0)
    return PackedLSTMForecaster(**kw)


class Seq2Seq(nn.Module):
    """A GRU encoder-decoder, teacher-forced: the decoder reads the previous true value (the
    last context value, then the future targets shifted by one), missing ones imputed as 0
    beside an observed flag."""

    def __init__(self, hidden: int = 16):
        super().__init__()
        self.encoder = nn.GRU(1, hidden, batch_first=True)
        self.decoder = nn.GRU(2, hidden, batch_first=True)
        self.head = nn.Linear(hidden, 1)

    def forward(self, past, future):  # (B, T), (B, H): future may hold NaN (missing)
        _, h = self.encoder(past.unsqueeze(-1))
        prev = torch.cat([past[:, -1:], future[:, :-1]], 1)
        observed = ~torch.isnan(prev)
        dec_in = torch.stack([torch.nan_to_num(prev), observed.to(prev.dtype)], -1)
        out, _ = self.decoder(dec_in, h)
        return self.head(out).squeeze(-1)


def make_seq2seq(**kw) -> nn.Module:
    torch.manual_seed(0)
    return Seq2Seq(**kw)
