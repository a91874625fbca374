"""Forecasting models and losses for ``test_timeseries``, written as the well-known repositories
write them (GluonTS's DeepAR heads, RevIN/PatchTST, N-BEATS and its losses), at module level
so that ``nanreplay`` rebuilds them from the bundle (``timeseries_models:make_deepar_nb``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import Categorical, NegativeBinomial, StudentT


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


class PatchTST(nn.Module):
    """A channel-independent PatchTST: RevIN, patches of ``patch`` steps embedded and run
    through a Transformer encoder, a flatten head to the horizon, RevIN's denorm."""

    def __init__(self, channels=2, context=32, horizon=8, patch=8, d=16, eps=1e-5):
        super().__init__()
        self.patch, self.n = patch, context // patch
        self.revin = RevIN(channels, eps=eps)
        self.embed = nn.Linear(patch, d)
        self.pos = nn.Parameter(torch.randn(self.n, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(self.n * d, horizon)

    def forward(self, x):  # (B, L, C)
        B, _, C = x.shape
        z = self.revin(x, "norm").permute(0, 2, 1).reshape(B * C, self.n, self.patch)
        z = self.encoder(self.embed(z) + self.pos)
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


def masked_nll(dist, y):
    """GluonTS's masked likelihood loss: missing targets (NaN) are left out of the mean."""
    observed = ~torch.isnan(y)
    return -(dist.log_prob(torch.nan_to_num(y)) * observed).sum() / observed.sum()


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


class BinnedForecaster(nn.Module):
    """A tokenised forecaster (Chronos-style): the scaled next value's bin as a ``Categorical``
    over ``bins`` levels, the bins above a series' capacity masked with -inf."""

    def __init__(self, context: int = 24, bins: int = 16, hidden: int = 32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(context, hidden), nn.ReLU(), nn.Linear(hidden, bins))
        self.register_buffer("levels", torch.arange(bins, dtype=torch.float32))

    def forward(self, past, capacity):  # (B, T), (B,) the highest bin each series can reach
        scale = past.abs().mean(1, keepdim=True).clamp_min(1e-3)
        logits = self.net(past / scale)
        return Categorical(logits=logits.masked_fill(self.levels > capacity[:, None],
                                                     float("-inf")))


def make_binned(**kw) -> nn.Module:
    torch.manual_seed(0)
    return BinnedForecaster(**kw)


def token_nll(dist, token):
    return -dist.log_prob(token).mean()
