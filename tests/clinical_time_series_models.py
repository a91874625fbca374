"""Clinical / EHR time series with missingness, written as the domain writes them.

GRU-D (Che et al. 2018): the input decay ``gamma_x = exp(-relu(W_x * delta + b_x))`` on each
variable's time since its last observation, the imputation
``x_hat = m * x + (1 - m) * (gamma_x * x_last + (1 - gamma_x) * mean)`` toward the
training-set mean, the hidden decay ``gamma_h`` before each GRU cell, two heads: in-hospital
mortality (a logit) and length of stay (``log(1 + days)``). A SeFT / mTAN-style set encoder over
the irregular ``(time, variable, value)`` triplets of a stay: a learned time embedding (linear +
periodic), a variable embedding, attention pooling of a learned query over the set under a
``key_padding_mask``. Stays are padded in ``collate_stays`` (a DataLoader's ``collate_fn``);
values are standardised by the training set's per-variable mean and std.

The losses: ``BCEWithLogitsLoss(pos_weight=n_neg / n_pos)`` for mortality, MSE on
``log1p(days)`` for the stay's length, and a masked MSE of a reconstruction head over the
observed entries only, divided by the observed count.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

N_VARS = 6          # heart rate, MAP, SpO2, temperature, lactate, creatinine
HOURS = 12


# ---------------------------------------------------------------------------- data


def simulate_stays(g: torch.Generator, n: int, hours: int = HOURS, p_obs: float = 0.4):
    """``n`` ICU stays of hourly bins: raw values (B, T, V), the observation mask, mortality
    labels and the length of stay in days. Vitals are observed often, labs rarely."""
    base = torch.tensor([85.0, 75.0, 96.0, 37.0, 2.0, 1.1])
    spread = torch.tensor([15.0, 10.0, 3.0, 0.7, 1.5, 0.6])
    rate = torch.tensor([0.9, 0.9, 0.8, 0.5, 0.15, 0.15]) * p_obs / 0.4
    risk = torch.randn(n, 1, 1, generator=g)
    x = base * torch.exp(spread / base * (0.5 * risk + torch.randn(n, hours, N_VARS, generator=g)))
    m = (torch.rand(n, hours, N_VARS, generator=g) < rate.clamp(max=1.0)).float()
    m[:, 0, :4] = 1.0  # the admission vitals
    died = (risk.view(n) + 0.5 * torch.randn(n, generator=g) > 1.0).float()
    los = torch.exp(1.0 + 0.5 * risk.view(n) + 0.3 * torch.randn(n, generator=g))
    return x, m, died, los


def training_stats(x: torch.Tensor, m: torch.Tensor):
    """Per-variable mean and std over the observed entries of the training set."""
    cnt = m.sum((0, 1))
    mean = (x * m).sum((0, 1)) / cnt
    var = (((x - mean) * m) ** 2).sum((0, 1)) / cnt
    return mean, var.sqrt()


def grud_inputs(x: torch.Tensor, m: torch.Tensor, mean: torch.Tensor, std: torch.Tensor,
                nan_missing: bool = False):
    """Standardised values, the time since each variable's last observation (hours) and its
    last observed value (the mean, 0 after standardising, before the first), as GRU-D reads
    them. ``nan_missing``: the missing entries left as NaN, as a pandas export writes them."""
    z = (x - mean) / std
    z = torch.where(m.bool(), z, torch.full_like(z, float("nan")) if nan_missing else 0.0)
    B, T, V = z.shape
    delta = torch.zeros(B, T, V)
    last = torch.zeros(B, T, V)
    prev_v = torch.zeros(B, V)
    for t in range(T):
        if t > 0:
            delta[:, t] = 1.0 + (1 - m[:, t - 1]) * delta[:, t - 1]
        last[:, t] = prev_v
        prev_v = torch.where(m[:, t].bool(), torch.nan_to_num(z[:, t]), prev_v)
    return z, m, delta, last


def collate_stays(stays):
    """Pads variable-length stays (T_i, V) to the longest; the padding is unobserved."""
    T = max(s["values"].shape[0] for s in stays)
    out = {}
    for key in ("values", "raw", "mask", "delta", "last"):
        out[key] = torch.stack([F.pad(s[key], (0, 0, 0, T - s[key].shape[0])) for s in stays])
    out["length"] = torch.tensor([s["values"].shape[0] for s in stays])
    out["died"] = torch.stack([s["died"] for s in stays])
    out["los"] = torch.stack([s["los"] for s in stays])
    return out


def stay_dataset(g: torch.Generator, n: int, mean=None, std=None, nan_missing=False,
                 hours: int = HOURS, p_obs: float = 0.4):
    """A list of stays of 6 to ``hours`` hours (dicts, for ``collate_stays``) and the
    training-set statistics."""
    x, m, died, los = simulate_stays(g, n, hours, p_obs)
    if mean is None:
        mean, std = training_stats(x, m)
    z, m, delta, last = grud_inputs(x, m, mean, std, nan_missing)
    lengths = torch.randint(6, hours + 1, (n,), generator=g)
    raw = x * m  # the chart's values, 0 where not charted
    stays = [{"values": z[i, :k], "raw": raw[i, :k], "mask": m[i, :k], "delta": delta[i, :k],
              "last": last[i, :k], "died": died[i], "los": los[i]}
             for i, k in enumerate(lengths.tolist())]
    return stays, mean, std


def triplets(batch: dict, minutes: bool = False):
    """The observed entries of a padded GRU-D batch as a SeFT set: times (B, S), variable ids
    (B, S), values (B, S) and the padding mask (B, S), True where padded. ``minutes``: the
    times in minutes since admission, as the chart export writes them."""
    m = batch["mask"]
    B, T, V = m.shape
    hours = torch.arange(T, dtype=torch.float32).view(1, T, 1).expand(B, T, V)
    var = torch.arange(V).view(1, 1, V).expand(B, T, V)
    counts = m.flatten(1).sum(1).long()
    S = int(counts.max())
    times, ids, vals = torch.zeros(B, S), torch.zeros(B, S, dtype=torch.long), torch.zeros(B, S)
    pad = torch.ones(B, S, dtype=torch.bool)
    for b in range(B):
        keep = m[b].flatten().bool()
        k = int(keep.sum())
        times[b, :k] = hours[b].flatten()[keep] * (60.0 if minutes else 1.0)
        ids[b, :k] = var[b].flatten()[keep]
        vals[b, :k] = torch.nan_to_num(batch["values"][b].flatten()[keep])
        pad[b, :k] = False
    return times, ids, vals, pad


# ---------------------------------------------------------------------------- models


class FilterLinear(nn.Module):
    """GRU-D's per-variable decay: a diagonal linear map of the time gaps."""

    def __init__(self, n: int):
        super().__init__()
        self.weight = nn.Parameter(torch.full((n,), 0.1))
        self.bias = nn.Parameter(torch.zeros(n))

    def forward(self, delta):
        return delta * self.weight + self.bias


class GRUD(nn.Module):
    def __init__(self, n_vars: int = N_VARS, hidden: int = 16, mean=None):
        super().__init__()
        self.decay_x = FilterLinear(n_vars)
        self.decay_h = nn.Linear(n_vars, hidden)
        self.cell = nn.GRUCell(2 * n_vars + hidden, hidden)
        self.register_buffer("x_mean", torch.zeros(n_vars) if mean is None else mean)
        self.mortality = nn.Linear(hidden, 1)
        self.los = nn.Linear(hidden, 1)
        self.recon = nn.Linear(hidden, n_vars)
        self.hidden = hidden

    def impute(self, x, m, delta, x_last):
        gamma_x = torch.exp(-torch.relu(self.decay_x(delta)))
        return m * x + (1 - m) * (gamma_x * x_last + (1 - gamma_x) * self.x_mean)

    def forward(self, x, m, delta, x_last, length):
        B, T, _ = x.shape
        h = x.new_zeros(B, self.hidden)
        recons = []
        for t in range(T):
            recons.append(self.recon(h))  # the next hour's values, from the past
            x_hat = self.impute(x[:, t], m[:, t], delta[:, t], x_last[:, t])
            gamma_h = torch.exp(-torch.relu(self.decay_h(delta[:, t])))
            h_new = self.cell(torch.cat([x_hat, h * gamma_h, m[:, t]], -1), h * gamma_h)
            live = (t < length).unsqueeze(1).to(h.dtype)  # padded hours keep the state
            h = live * h_new + (1 - live) * h
        return self.mortality(h).squeeze(-1), self.los(h).squeeze(-1), torch.stack(recons, 1)


class TimeEmbedding(nn.Module):
    """mTAN's learned time embedding: one linear and ``dim - 1`` periodic components."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(1, 1)
        self.periodic = nn.Linear(1, dim - 1)

    def forward(self, t):
        t = t.unsqueeze(-1)
        return torch.cat([self.linear(t), torch.sin(self.periodic(t))], -1)


class SetEncoder(nn.Module):
    """SeFT / mTAN-style: each observation embedded from its time, variable and value,
    mixed by self-attention over the set under the padding mask, pooled by a learned query."""

    def __init__(self, n_vars: int = N_VARS, dim: int = 16, heads: int = 2):
        super().__init__()
        self.time = TimeEmbedding(dim)
        self.var = nn.Embedding(n_vars, dim)
        self.value = nn.Linear(1, dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.query = nn.Parameter(torch.randn(1, 1, dim) * 0.1)
        self.pool = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mortality = nn.Linear(dim, 1)
        self.los = nn.Linear(dim, 1)

    def forward(self, times, ids, vals, pad):
        e = self.time(times) + self.var(ids) + self.value(vals.unsqueeze(-1))
        e = e + self.attn(e, e, e, key_padding_mask=pad, need_weights=False)[0]
        q = self.query.expand(len(e), -1, -1)
        z = self.pool(q, e, e, key_padding_mask=pad, need_weights=False)[0].squeeze(1)
        return self.mortality(z).squeeze(-1), self.los(z).squeeze(-1)


def make_grud(mean=None):
    torch.manual_seed(0)
    return GRUD(mean=mean)


def make_seft():
    torch.manual_seed(0)
    return SetEncoder()


# ---------------------------------------------------------------------------- losses


def masked_mse(pred, target, mask):
    """MSE over the observed entries only, per stay, divided by the stay's observed count."""
    se = ((pred - target) * mask) ** 2
    return (se.flatten(1).sum(1) / mask.flatten(1).sum(1)).mean()


def log_lab_mse(pred, raw, mask):
    """The reconstruction in log units of the raw (log-normal) values, the hours not charted
    (0 in ``raw``) left out with ``torch.where``."""
    se = torch.where(mask.bool(), (pred - torch.log(raw)) ** 2, 0.0)
    return se.sum() / mask.sum()


class ClinicalLoss(nn.Module):
    """Mortality (BCE with logits, ``pos_weight`` for the rare deaths) + length of stay (MSE on
    ``log1p(days)``) + ``recon_weight`` times the masked reconstruction MSE."""

    def __init__(self, pos_weight: float = 4.0, recon_weight: float = 0.5, recon=masked_mse):
        super().__init__()
        self.bce = nn.BCEWithLogitsLoss(pos_weight=torch.tensor(pos_weight))
        self.recon_weight = recon_weight
        self.recon = recon

    def forward(self, out, died, los, values=None, mask=None):
        logit, log_los = out[0], out[1]
        loss = self.bce(logit, died) + F.mse_loss(log_los, torch.log1p(los))
        if values is not None:
            loss = loss + self.recon_weight * self.recon(out[2], values, mask)
        return loss


class LogLosLoss(nn.Module):
    """Mortality BCE + the length of stay regressed on ``log(days)``."""

    def __init__(self, pos_weight: float = 4.0):
        super().__init__()
        self.bce = nn.BCEWithLogitsLoss(pos_weight=torch.tensor(pos_weight))

    def forward(self, out, died, los):
        return self.bce(out[0], died) + F.mse_loss(out[1], torch.log(los))


class HandBCE(nn.Module):
    """The class-weighted BCE written out on probabilities, as a paper's equation reads."""

    def __init__(self, pos_weight: float = 4.0):
        super().__init__()
        self.pos_weight = pos_weight

    def forward(self, out, died, los):
        p = torch.sigmoid(out[0])
        bce = -(self.pos_weight * died * torch.log(p) + (1 - died) * torch.log(1 - p))
        return bce.mean() + F.mse_loss(out[1], torch.log1p(los))


def batch_pos_weight(died: torch.Tensor) -> torch.Tensor:
    """``n_neg / n_pos`` of the batch, as a loop re-weighting each batch writes it."""
    return (1 - died).sum() / died.sum()


class BatchWeightedLoss(nn.Module):
    """BCE with logits under the batch's own ``n_neg / n_pos`` + the length-of-stay MSE."""

    def forward(self, out, died, los):
        bce = F.binary_cross_entropy_with_logits(out[0], died, pos_weight=batch_pos_weight(died))
        return bce + F.mse_loss(out[1], torch.log1p(los))


def make_grud_drifted(bias: float = 20.0):
    """A GRU-D checkpoint whose mortality head's bias drifted far positive."""
    model = make_grud()
    with torch.no_grad():
        model.mortality.bias.fill_(bias)
    return model


def blank_stay(stays, i: int):
    """Stay ``i`` with no charted value in its window (a transfer whose charts went to
    another unit)."""
    s = stays[i]
    for key in ("values", "raw", "mask", "last"):
        s[key].zero_()


def whole_days(stays, same_day: int):
    """Lengths of stay in whole days from the admission and discharge dates; stay
    ``same_day`` discharged on the day of its admission."""
    for s in stays:
        s["los"] = s["los"].ceil()
    stays[same_day]["los"] = torch.tensor(0.0)


def survivors_only(stays, start: int):
    """No death among the stays from ``start`` on."""
    for s in stays[start:]:
        s["died"] = torch.tensor(0.0)


def make_seft_scaled(scale: float = 1.0):
    """A SeFT whose time embedding's linear component was trained on times in hours."""
    model = make_seft()
    with torch.no_grad():
        model.time.linear.weight.fill_(scale)
    return model


class Standardise(nn.Module):
    """The training set's per-variable mean and std as buffers, applied to the charted
    values inside the model (the uncharted ones set to 0, the mean after standardising)."""

    def __init__(self, n_vars: int = N_VARS):
        super().__init__()
        self.register_buffer("mean", torch.zeros(n_vars))
        self.register_buffer("std", torch.ones(n_vars))

    def forward(self, raw, m):
        return torch.where(m.bool(), (raw - self.mean) / self.std, 0.0)


class StandardisedGRUD(nn.Module):
    """GRU-D fed the raw charted values through :class:`Standardise`."""

    def __init__(self):
        super().__init__()
        self.norm = Standardise()
        self.grud = GRUD()

    def forward(self, raw, m, delta, x_last, length):
        return self.grud(self.norm(raw, m), m, delta, x_last, length)


def make_grud_standardised():
    torch.manual_seed(0)
    return StandardisedGRUD()
