"""Rainfall-runoff models as neuralhydrology and the dPL/HBV papers write them, for
``test_hydrology``.

- ``EALSTM``: Kratzert et al.'s entity-aware LSTM, its input gate from the catchment's static
  attributes alone, the forget/cell/output gates from the daily forcings, written as a loop
  over days; sequence-to-one (the last day's discharge after a warm-up period), with a
  static-attribute embedding ``Linear`` in front of the input gate.
- ``NSELoss``: the basin-averaged NSE* loss ``(y_hat - y)^2 / (std_basin + eps)^2``, with each
  basin's discharge std from the training period handed in with the batch, and NaN discharge
  (gauge gaps) masked out.
- ``LogQLoss``: MSE against ``log(q + c)`` of the observed discharge.
- ``BucketModel``: a differentiable conceptual model (HBV's soil box, dPL style): parameters
  from the static attributes through a small network and sigmoid bounds, an explicit Euler
  step per day with ``ET = PET (S / Smax)^beta``, PET from a temperature ``c exp(a T)``; the
  store clamped at 0 after each step, or at a small floor.
"""

from __future__ import annotations

import torch
from torch import nn

N_DYN, N_STATIC, SEQ, WARMUP = 3, 4, 24, 8


class EALSTM(nn.Module):
    """Entity-aware LSTM over ``x_d (B, T, N_DYN)`` and ``x_s (B, N_STATIC)``."""

    def __init__(self, hidden: int = 16):
        super().__init__()
        self.embed = nn.Linear(N_STATIC, hidden)
        self.input_gate = nn.Linear(hidden, hidden)
        self.dynamic = nn.Linear(N_DYN + hidden, 3 * hidden)
        self.head = nn.Linear(hidden, 1)
        self.dropout = nn.Dropout(0.1)
        self.hidden = hidden

    def forward(self, x_d, x_s):
        i = torch.sigmoid(self.input_gate(torch.tanh(self.embed(x_s))))
        h = x_d.new_zeros(x_d.shape[0], self.hidden)
        c = torch.zeros_like(h)
        for t in range(x_d.shape[1]):
            f, o, g = self.dynamic(torch.cat([x_d[:, t], h], 1)).chunk(3, 1)
            c = torch.sigmoid(f) * c + i * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
        return self.head(self.dropout(h))  # sequence-to-one: the last day's discharge


def make_ealstm() -> EALSTM:
    torch.manual_seed(0)
    return EALSTM()


class NSELoss(nn.Module):
    """neuralhydrology's NSE*: squared errors weighted per basin by 1 / (std + eps)^2."""

    def __init__(self, eps: float = 0.1):
        super().__init__()
        self.eps = eps

    def forward(self, y_hat, y, q_std):
        mask = ~torch.isnan(y)
        weights = 1 / (q_std + self.eps) ** 2
        scaled = weights[mask] * (y_hat[mask] - y[mask]) ** 2
        return scaled.mean()


class LogQLoss(nn.Module):
    """MSE of the prediction against log-transformed discharge ``log(q + c)``."""

    def __init__(self, c: float = 0.01):
        super().__init__()
        self.c = c

    def forward(self, y_hat, q):
        return ((y_hat - torch.log(q + self.c)) ** 2).mean()


def masked_mse(y_hat, y):
    """MSE on standardised discharge over the days with an observation (gauge gaps are NaN)."""
    mask = ~torch.isnan(y)
    return ((y_hat[mask] - y[mask]) ** 2).sum() / mask.sum()


def standardised_mse(y_hat, y, q_mean, q_std):
    """MSE on discharge standardised per basin by the training period's mean and std."""
    return ((y_hat - (y - q_mean) / q_std) ** 2).mean()


def nanmean_mse(y_hat, y):
    """The masked MSE written with ``torch.nanmean``: the gaps' NaN errors are skipped."""
    return torch.nanmean((y_hat - y) ** 2)


def where_masked_mse(y_hat, y):
    """The same masked MSE that zeroes the gaps by ``torch.where`` and floors the count."""
    mask = ~torch.isnan(y)
    err = torch.where(mask, y_hat - torch.nan_to_num(y), torch.zeros_like(y_hat))
    return (err ** 2).sum() / mask.sum().clamp_min(1)


class BucketModel(nn.Module):
    """One soil bucket per basin, Euler-stepped over ``x_d (B, T, [P, T_air])``:
    ``S += P - PET (S / Smax)^beta - k S``; discharge ``k S`` on the last day."""

    def __init__(self, floor: float | None = None, limit_et: bool = False, hidden: int = 16):
        super().__init__()
        self.params = nn.Sequential(nn.Linear(N_STATIC, hidden), nn.Tanh(),
                                    nn.Linear(hidden, 3))
        self.pet_a = nn.Parameter(torch.tensor(0.35))  # PET growth per degree above 20 C
        self.pet_c = nn.Parameter(torch.tensor(2.0))  # PET at 20 C, mm/day
        self.floor, self.limit_et = floor, limit_et

    def forward(self, x_d, x_s):
        raw = torch.sigmoid(self.params(x_s))
        smax = 20 + 480 * raw[:, 0]  # 20-500 mm
        beta = 0.1 + 0.9 * raw[:, 1]  # a fractional shape of the ET curve
        k = 0.01 + 0.5 * raw[:, 2]
        s = 0.5 * smax
        for t in range(x_d.shape[1]):
            p, temp = x_d[:, t, 0], x_d[:, t, 1]
            pet = self.pet_c * torch.exp(self.pet_a * (temp - 20))
            et = pet * (s / smax) ** beta
            if self.limit_et:  # no more evaporation than the store holds
                et = torch.minimum(et, s)
            s = s + p - et - k * s
            if self.floor is not None:  # keep the store inside [floor, Smax]
                s = torch.minimum(s.clamp_min(self.floor), smax)
        return (k * s).unsqueeze(1)


def make_bucket() -> BucketModel:
    torch.manual_seed(0)
    return BucketModel()


def make_bucket_clamped() -> BucketModel:
    """The store clamped at 0: its forward stays finite, and the power's derivative
    ``beta S^(beta - 1)`` at S = 0 is infinite for a fractional beta."""
    torch.manual_seed(0)
    return BucketModel(floor=0.0)


def make_bucket_floored() -> BucketModel:
    torch.manual_seed(0)
    return BucketModel(floor=1e-6)


def make_bucket_limited() -> BucketModel:
    """ET limited to the store (``min(ET, S)``) and the store floored: finite in forward."""
    torch.manual_seed(0)
    return BucketModel(floor=1e-6, limit_et=True)


# ---------------------------------------------------------------------------------------------
# data: windows of basins


def basin_batch(g: torch.Generator, n: int = 8, zero_flow: int | None = None,
                gaps: bool = False, all_gaps: bool = False, nan_static: int | None = None,
                glacier_free: bool = False):
    """EA-LSTM windows: standardised forcings, static attributes, the last day's discharge
    (mm/day) and each basin's discharge std over the training period. ``zero_flow``: an
    ephemeral stream recorded as 0 every day (its std 0); ``gaps``: two missing gauge
    readings; ``all_gaps``: a window where no basin's gauge reported; ``nan_static``: a basin
    with a missing soil property; ``glacier_free``: the last attribute, a glacier fraction 0 in
    every basin, standardised by its std of 0."""
    x_d = torch.randn(n, SEQ, N_DYN, generator=g)
    x_s = torch.randn(n, N_STATIC, generator=g)
    q = 0.5 + torch.rand(n, 1, generator=g) * 3
    q_std = 0.3 + torch.rand(n, 1, generator=g)
    if zero_flow is not None:
        q[zero_flow], q_std[zero_flow] = 0.0, 0.0
    if gaps:
        q[[1, 4]] = float("nan")
    if all_gaps:
        q[:] = float("nan")
    if nan_static is not None:
        x_s[nan_static, 2] = float("nan")
    if glacier_free:  # a glacier fraction 0 in every training basin, standardised by its std
        frac = torch.zeros(n, 1)
        x_s = torch.cat([x_s[:, :-1], (frac - frac.mean(0)) / frac.std(0)], 1)
    return x_d, x_s, q, q_std


def bucket_batch(g: torch.Generator, n: int = 8, dry: int | None = None,
                 kelvin: int | None = None):
    """Conceptual-model windows: daily precipitation (mm) and air temperature (degrees
    Celsius), static attributes, the last day's discharge. ``dry``: an arid basin with no rain
    in the window and hot days; ``kelvin``: a basin whose temperature file is in Kelvin."""
    p = torch.rand(n, SEQ, generator=g) * 8 * (torch.rand(n, SEQ, generator=g) > 0.5)
    temp = 5 + 15 * torch.rand(n, SEQ, generator=g)
    x_s = torch.randn(n, N_STATIC, generator=g)
    q = torch.rand(n, 1, generator=g) * 2
    if dry is not None:
        p[dry], temp[dry] = 0.0, 27 + 4 * torch.rand(SEQ, generator=g)
    if kelvin is not None:
        temp[kelvin] += 273.15
    return torch.stack([p, temp], 2), x_s, q


class AttentionLSTM(nn.Module):
    """``nn.LSTM`` over the days, then attention pooling over the days with a record (the
    days before a gauge's record starts padded and masked with -inf), a head of ``H`` daily
    horizons: multi-horizon forecasts."""

    def __init__(self, hidden: int = 16, horizons: int = 3):
        super().__init__()
        self.lstm = nn.LSTM(N_DYN + N_STATIC, hidden, batch_first=True)
        self.score = nn.Linear(hidden, 1)
        self.head = nn.Linear(hidden, horizons)

    def forward(self, x_d, x_s, recorded):
        x = torch.cat([x_d, x_s[:, None].expand(-1, x_d.shape[1], -1)], 2)
        h, _ = self.lstm(x)
        scores = self.score(h).squeeze(2).masked_fill(~recorded, float("-inf"))
        w = torch.softmax(scores, 1)  # NaN for a window with no recorded day
        return self.head((w[:, :, None] * h).sum(1))


def make_attention() -> AttentionLSTM:
    torch.manual_seed(0)
    return AttentionLSTM()


class BasinWindows(torch.utils.data.Dataset):
    """Windows of basins whose records start at different days (padding before the start);
    ``late``: a basin whose record starts after the window ends (no recorded day in it)."""

    def __init__(self, n: int = 32, horizons: int = 3, late: int | None = None, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.x_d = torch.randn(n, SEQ, N_DYN, generator=g)
        self.x_s = torch.randn(n, N_STATIC, generator=g)
        start = torch.randint(0, SEQ // 2, (n,), generator=g)
        if late is not None:
            start[late] = SEQ
        self.recorded = torch.arange(SEQ)[None] >= start[:, None]
        self.x_d[~self.recorded] = 0.0
        self.q = torch.randn(n, horizons, generator=g)
        self.q[torch.rand(n, horizons, generator=g) < 0.1] = float("nan")  # gauge gaps

    def __len__(self):
        return len(self.q)

    def __getitem__(self, i):
        return self.x_d[i], self.x_s[i], self.recorded[i], self.q[i]
