"""Quantitative finance models written the way their public repositories write them; the
factories and losses of ``test_quant_finance.py``.

- ``PortfolioLSTM`` + ``sharpe_loss``: Zhang, Zohren & Roberts, "Deep Learning for Portfolio
  Optimization" (2020; e.g. github.com/shilewenuw/deep-learning-portfolio-optimization): an LSTM
  over the assets' log returns, portfolio weights from a softmax over assets, the loss minus the
  Sharpe ratio ``mean(R) / std(R)`` of the window's portfolio returns.
- ``log_returns``: the features of that repo and of most quant notebooks,
  ``log(p_t / p_{t-1})`` of a price table (a forward-filled table keeps a 0 price where a
  listing started at 0, or a missing first print filled with 0).
- ``MomentumNet``: Lim, Zohren & Roberts, "Enhancing Time Series Momentum Strategies Using Deep
  Neural Networks" (github.com/kieranjwood/trading-momentum-transformer): positions scaled by
  volatility targeting ``sigma_tgt / sigma_t`` with ``sigma_t`` the realised volatility.
- ``DeepHedger``: Buehler et al. "Deep Hedging" as pfnet-research/pfhedge writes it: the
  Black-Scholes delta ``ncdf(d1)``, ``d1 = (log(S/K) + sigma^2/2 * T) / (sigma * sqrt(T))``
  with a learned implied volatility, plus a network's correction; the last rebalancing date is
  at expiry (``T = 0``).
- ``DeepLOB``: Zhang, Zohren & Roberts, "DeepLOB" (github.com/zcakhaa/DeepLOB-Deep-
  Convolutional-Neural-Networks-for-Limit-Order-Books): order-book levels normalised by a
  rolling z-score over the window, then conv + LSTM.
- ``quantile_loss`` / ``expected_shortfall``: the pinball loss of the Temporal Fusion
  Transformer (google-research/tft, pytorch-forecasting's ``QuantileLoss``) and CVaR by
  sorting (the worst ``ceil(alpha * n)`` outcomes) or in the Rockafellar-Uryasev form.
"""

from __future__ import annotations

import math

import torch
from torch import nn

ASSETS, WINDOW, HIDDEN = 4, 16, 8


def log_returns(prices):
    """(B, T+1, A) prices -> (B, T, A) log returns, as ``np.log(df / df.shift(1))``."""
    return torch.log(prices[:, 1:] / prices[:, :-1])


class PortfolioLSTM(nn.Module):
    """LSTM over the assets' log returns; the last hidden state -> softmax weights."""

    def __init__(self, assets: int = ASSETS, hidden: int = HIDDEN):
        super().__init__()
        self.lstm = nn.LSTM(assets, hidden, batch_first=True)
        self.head = nn.Linear(hidden, assets)

    def forward(self, prices):  # (B, T+1, A) prices of the look-back window
        features = log_returns(prices)
        out, _ = self.lstm(features)
        return torch.softmax(self.head(out[:, -1]), dim=-1)  # (B, A) long-only weights


def make_portfolio() -> nn.Module:
    torch.manual_seed(0)
    return PortfolioLSTM()


def sharpe_loss(weights, future_returns):
    """Minus the Sharpe ratio of the portfolio over the holding window (B, H, A)."""
    r = (weights[:, None, :] * future_returns).sum(-1)  # (B, H) portfolio returns
    sharpe = r.mean(1) / r.std(1)
    return -sharpe.mean()


def sharpe_loss_eps(weights, future_returns):
    r = (weights[:, None, :] * future_returns).sum(-1)
    return -(r.mean(1) / (r.std(1) + 1e-8)).mean()


class MomentumNet(nn.Module):
    """Deep momentum network: tanh positions, volatility-scaled to a 15% annual target."""

    def __init__(self, features: int = 3, hidden: int = HIDDEN, sigma_tgt: float = 0.15):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.Tanh(), nn.Linear(hidden, 1))
        self.sigma_tgt = sigma_tgt

    def forward(self, feats, past_returns):  # (B, F), (B, W) daily returns of each asset
        position = torch.tanh(self.net(feats))[:, 0]
        sigma_t = past_returns.std(1) * math.sqrt(252)  # ex-ante realised volatility
        return position * self.sigma_tgt / sigma_t  # leverage


def make_momentum() -> nn.Module:
    torch.manual_seed(0)
    return MomentumNet()


def strategy_loss(leverage, next_returns):
    """Minus the mean captured return (the paper's return loss)."""
    return -(leverage * next_returns).mean()


def norm_cdf(x):
    return 0.5 * (1 + torch.erf(x / math.sqrt(2)))


class DeepHedger(nn.Module):
    """Black-Scholes delta at a learned implied vol plus a network's correction."""

    def __init__(self, strike: float = 1.0, hidden: int = HIDDEN):
        super().__init__()
        self.log_sigma = nn.Parameter(torch.tensor(math.log(0.2)))
        self.net = nn.Sequential(nn.Linear(2, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        self.strike = strike

    def delta(self, spot, time_to_maturity):
        sigma = self.log_sigma.exp()
        log_moneyness = torch.log(spot / self.strike)
        d1 = (log_moneyness + sigma ** 2 / 2 * time_to_maturity) / (
            sigma * time_to_maturity.sqrt())
        return norm_cdf(d1)

    def forward(self, spot, time_to_maturity):  # (B, N) paths and (N,) years left per date
        ttm = time_to_maturity.expand_as(spot)
        features = torch.stack([torch.log(spot / self.strike), ttm], -1)
        return self.delta(spot, ttm) + 0.1 * torch.tanh(self.net(features))[..., 0]


def make_hedger() -> nn.Module:
    torch.manual_seed(0)
    return DeepHedger()


def hedging_pnl_loss(hedge, spot):
    """Entropic-risk-free proxy: the variance of the hedged short call's P&L."""
    gains = (hedge[:, :-1] * spot.diff(dim=1)).sum(1)
    payoff = (spot[:, -1] - 1.0).clamp_min(0)
    pnl = gains - payoff
    return pnl.var()


def rolling_zscore(x, eps: float = 0.0):
    """DeepLOB's normalisation: each level by the window's mean and std, per sample."""
    mean = x.mean(1, keepdim=True)
    std = x.std(1, keepdim=True)
    return (x - mean) / (std + eps)


class DeepLOB(nn.Module):
    """Conv over (price, volume) pairs of the book's levels, then an LSTM, 3 classes."""

    def __init__(self, levels: int = 4, hidden: int = HIDDEN, eps: float = 0.0):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(1, 4, (1, 2), stride=(1, 2)), nn.LeakyReLU(0.01))
        self.lstm = nn.LSTM(4 * levels, hidden, batch_first=True)
        self.fc = nn.Linear(hidden, 3)
        self.eps = eps

    def forward(self, book):  # (B, T, 2 * levels) prices and volumes
        x = rolling_zscore(book, self.eps)
        x = self.conv(x[:, None])  # (B, 4, T, levels)
        x = x.permute(0, 2, 1, 3).flatten(2)
        out, _ = self.lstm(x)
        return self.fc(out[:, -1])


def make_deeplob() -> nn.Module:
    torch.manual_seed(0)
    return DeepLOB()


class QuantileForecaster(nn.Module):
    """A TFT-sized stand-in: GRU encoder, one output per quantile of the next value."""

    def __init__(self, quantiles=(0.1, 0.5, 0.9), hidden: int = HIDDEN):
        super().__init__()
        self.gru = nn.GRU(1, hidden, batch_first=True)
        self.out = nn.Linear(hidden, len(quantiles))
        self.quantiles = quantiles

    def forward(self, past):  # (B, T) a price series, normalised by its encoder scale
        scale = past.abs().mean(1, keepdim=True)
        h, _ = self.gru((past / scale)[..., None])
        return self.out(h[:, -1]) * scale


def make_quantile() -> nn.Module:
    torch.manual_seed(0)
    return QuantileForecaster()


QUANTILES = torch.tensor([0.1, 0.5, 0.9])


def quantile_loss(pred, target):
    """pytorch-forecasting's QuantileLoss: the pinball loss of each quantile."""
    errors = target[:, None] - pred
    return torch.max((QUANTILES - 1) * errors, QUANTILES * errors).mean()


def expected_shortfall(weights, future_returns, alpha: float = 0.05):
    """CVaR of the portfolio's losses by sorting: the mean of the worst int(alpha * n)."""
    losses = -(weights[:, None, :] * future_returns).sum(-1).flatten()
    k = int(alpha * losses.numel())
    worst = losses.sort(descending=True).values[:k]
    return worst.mean()


def cvar_ru(weights, future_returns, var, beta: float = 0.95):
    """Rockafellar-Uryasev: VaR + E[(loss - VaR)+] / (1 - beta)."""
    losses = -(weights[:, None, :] * future_returns).sum(-1)
    return var + torch.relu(losses - var).mean() / (1 - beta)


class MaskedPortfolio(PortfolioLSTM):
    """Weights only over the assets tradable that day: the untradable ones' logits set to
    ``-inf`` before the softmax (an additive mask, as universe filters are written)."""

    def forward(self, prices, tradable):  # (B, T+1, A), (B, A) bool
        features = log_returns(prices)
        out, _ = self.lstm(features)
        logits = self.head(out[:, -1]).masked_fill(~tradable, float("-inf"))
        return torch.softmax(logits, dim=-1)


def make_masked_portfolio() -> nn.Module:
    torch.manual_seed(0)
    return MaskedPortfolio()


def daily_cvar(weights, future_returns):
    """1% expected shortfall of one batch's portfolio returns (``k = int(0.01 * n)``)."""
    return expected_shortfall(weights, future_returns, alpha=0.01)


def entropic_risk(hedge, spot, risk_aversion: float = 10.0):
    """The entropic risk of the hedged short call's P&L, written from its definition
    ``log E[exp(-a * pnl)] / a`` (pfhedge's EntropicRiskMeasure uses logsumexp)."""
    gains = (hedge[:, :-1] * spot.diff(dim=1)).sum(1)
    pnl = gains - (spot[:, -1] - 100.0).clamp_min(0)
    return torch.log(torch.exp(-risk_aversion * pnl).mean()) / risk_aversion


class DollarHedger(DeepHedger):
    def __init__(self):
        super().__init__(strike=100.0)


def make_dollar_hedger() -> nn.Module:
    torch.manual_seed(0)
    return DollarHedger()


class ReluPortfolio(PortfolioLSTM):
    """Long-only weights as ReLU scores over their sum (no softmax)."""

    def forward(self, prices):
        out, _ = self.lstm(log_returns(prices))
        score = torch.relu(self.head(out[:, -1]))
        return score / score.sum(-1, keepdim=True)


def make_relu_portfolio() -> nn.Module:
    torch.manual_seed(0)
    return ReluPortfolio()


class VolumeLOB(DeepLOB):
    """DeepLOB with the book's volumes as log-volumes (an empty level has volume 0)."""

    def forward(self, book):
        x = torch.cat([book[..., ::2], torch.log(book[..., 1::2])], -1)
        return super().forward(x)


def make_volume_lob() -> nn.Module:
    torch.manual_seed(0)
    return VolumeLOB(eps=1e-5)
