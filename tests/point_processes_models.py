"""Neural temporal point processes written the way their public repositories write them, the
factories of ``test_point_processes.py``:

- ``RMTPP`` (Du et al. 2016), as woshiyyya/ERPP-RMTPP and musically-ut/tf_rmtpp write it: a GRU
  over (type embedding, inter-event time); the intensity ``exp(v.h + w * dt + b)`` with ``w``
  and ``b`` learned scalars and its integral in closed form, ``(exp(v.h + b) - exp(v.h + w *
  dt + b)) / w``; optionally the times divided by the mean inter-event time of the batch.
- ``THP`` (Zuo et al. 2020), as SimiaoZuo/Transformer-Hawkes-Process writes it: a type embedding
  with ``padding_idx``, the sinusoidal temporal encoding, masked self-attention, intensities
  ``softplus(linear(h), beta)`` with the repository's own ``softplus`` (``temp[temp > 20] =
  20``, a learned ``beta``), ``compute_event`` and the Monte-Carlo integral of the intensity
  over uniformly sampled times (``compute_integral_unbiased``).
- ``LogNormMix`` (Shchur et al. 2020), as shchur/ifl-tpp writes it: intensity-free, the log
  inter-event times as the GRU's features (``log(inter_times + 1e-8)``, standardised), a
  mixture of log-normals whose log-density is a ``logsumexp`` over ``log_softmax`` weights
  at ``inter_times.clamp(1e-10)``; or (``floor=None``) the repository's
  ``LogNormalMixtureDistribution`` built from ``torch.distributions`` (``MixtureSameFamily``
  under an affine and an exp transform), given the inter-event times as they are.

The planted bugs are options of the factories: ``w_init=0.0``, ``batch_time_scale``,
``guard`` (how ``compute_event`` keeps the pads' log out), ``beta``, ``threshold=None`` (THP's
softplus without its hard threshold at 20), ``feature_eps=0.0``, ``floor=None``.

Sequences come padded from a ``DataLoader`` with ``pad_events`` as its ``collate_fn``: times,
types (0 is the pad) and a float mask.
"""

from __future__ import annotations

import math

import torch
import torch.distributions as D
import torch.nn.functional as F
from torch import nn

NUM_TYPES, EMBED, HIDDEN, MIX = 3, 8, 16, 4


def pad_events(seqs):
    """``collate_fn``: ``[(times, types), ...]`` to ``(times, types, mask)``, right-padded."""
    n = max(len(t) for t, _ in seqs)
    times = torch.zeros(len(seqs), n)
    types = torch.zeros(len(seqs), n, dtype=torch.long)
    for i, (t, k) in enumerate(seqs):
        times[i, :len(t)] = t
        types[i, :len(k)] = k
    return times, types, types.ne(0).float()


def sequences(g, n, length, gap=1.0):
    """``n`` sequences of ``length`` events, exponential gaps of mean ``gap``."""
    out = []
    for _ in range(n):
        gaps = torch.empty(length).exponential_(1.0 / gap, generator=g) + 0.05
        out.append((gaps.cumsum(0), torch.randint(1, NUM_TYPES + 1, (length,), generator=g)))
    return out


# ---------------------------------------------------------------------------------------------
# RMTPP


class RMTPP(nn.Module):
    def __init__(self, w_init=0.1, batch_time_scale=False, w_min=None):
        super().__init__()
        self.embed = nn.Embedding(NUM_TYPES + 1, EMBED, padding_idx=0)
        self.rnn = nn.GRU(EMBED + 1, HIDDEN, batch_first=True)
        self.hidden = nn.Linear(HIDDEN, HIDDEN)
        self.past = nn.Linear(HIDDEN, 1)  # v . h
        self.mark = nn.Linear(HIDDEN, NUM_TYPES + 1)
        self.intensity_w = nn.Parameter(torch.tensor(w_init))
        self.intensity_b = nn.Parameter(torch.tensor(0.1))
        self.batch_time_scale, self.w_min = batch_time_scale, w_min

    def forward(self, times, types, mask):
        dt = torch.diff(times, dim=1, prepend=times[:, :1]) * mask
        if self.batch_time_scale:  # times in units of the batch's mean inter-event time
            gaps = dt[:, 1:][mask[:, 1:].bool()]
            dt = dt / gaps.mean()
        x = torch.cat([self.embed(types), dt.unsqueeze(-1)], dim=-1)
        h, _ = self.rnn(x)
        h = torch.relu(self.hidden(h[:, :-1]))
        pred, gold = self.past(h).squeeze(-1), dt[:, 1:]
        w, b = self.intensity_w, self.intensity_b
        if self.w_min is not None:  # an intensity that never decays with time
            w = w.clamp(min=self.w_min)
        time_ll = (pred + w * gold + b
                   + (torch.exp(pred + b) - torch.exp(pred + w * gold + b)) / w)
        return time_ll, self.mark(h)


def rmtpp_loss(out, types, mask):
    """Negative log-likelihood per event: time and mark."""
    time_ll, mark_logits = out
    m = mask[:, 1:]
    mark_nll = F.cross_entropy(mark_logits.reshape(-1, NUM_TYPES + 1), types[:, 1:].reshape(-1),
                               ignore_index=0, reduction="sum")
    return (-(time_ll * m).sum() + mark_nll) / m.sum()


def make_rmtpp(**kw):
    torch.manual_seed(0)
    return RMTPP(**kw)


# ---------------------------------------------------------------------------------------------
# Transformer Hawkes Process


def softplus(x, beta, threshold=20):
    # hard thresholding at 20
    temp = beta * x
    if threshold is not None:
        temp[temp > threshold] = threshold
    return 1.0 / beta * torch.log(1 + torch.exp(temp))


def compute_event(event, non_pad_mask, guard):
    """Log-likelihood of events."""
    if guard == "where":  # log where there is an event, 0 at the pads
        return torch.where(non_pad_mask.bool(), torch.log(event), torch.zeros_like(event))
    if guard == "product":  # the log, times the mask
        return torch.log(event) * non_pad_mask
    if guard != "masked":  # add 1e-9 in case some events have 0 likelihood
        event += math.pow(10, -9)
    event.masked_fill_(~non_pad_mask.bool(), 1.0)
    return torch.log(event)


def compute_integral_unbiased(model, data, time, non_pad_mask, type_mask):
    """Log-likelihood of non-events, using Monte Carlo integration."""
    num_samples = 20
    diff_time = (time[:, 1:] - time[:, :-1]) * non_pad_mask[:, 1:]
    temp_time = diff_time.unsqueeze(2) * torch.rand([*diff_time.size(), num_samples])
    temp_time /= (time[:, :-1] + 1).unsqueeze(2)
    temp_hid = model.linear(data)[:, 1:, :]
    temp_hid = torch.sum(temp_hid * type_mask[:, 1:, :], dim=2, keepdim=True)
    all_lambda = softplus(temp_hid + model.alpha * temp_time, model.beta)
    all_lambda = torch.sum(all_lambda, dim=2) / num_samples
    return all_lambda * diff_time


class THP(nn.Module):
    def __init__(self, guard="eps", beta=1.0, threshold=20):
        super().__init__()
        d = HIDDEN
        self.num_types = NUM_TYPES
        self.register_buffer("position_vec", torch.tensor(
            [math.pow(10000.0, 2.0 * (i // 2) / d) for i in range(d)]))
        self.event_emb = nn.Embedding(NUM_TYPES + 1, d, padding_idx=0)
        self.w_qs, self.w_ks = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.w_vs, self.fc = nn.Linear(d, d, bias=False), nn.Linear(d, d)
        self.layer_norm = nn.LayerNorm(d, eps=1e-6)
        self.linear = nn.Linear(d, NUM_TYPES)
        self.alpha = nn.Parameter(torch.tensor(-0.1))
        self.beta = nn.Parameter(torch.tensor(beta))
        self.guard, self.threshold = guard, threshold

    def temporal_enc(self, time, non_pad_mask):
        result = time.unsqueeze(-1) / self.position_vec
        result[:, :, 0::2] = torch.sin(result[:, :, 0::2])
        result[:, :, 1::2] = torch.cos(result[:, :, 1::2])
        return result * non_pad_mask

    def encode(self, event_type, event_time, non_pad_mask):
        t = event_type.shape[1]
        subsequent = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
        slf_attn_mask = event_type.eq(0).unsqueeze(1) | subsequent  # keys: pads and future
        enc = self.event_emb(event_type) + self.temporal_enc(event_time, non_pad_mask)
        q, k, v = self.w_qs(enc), self.w_ks(enc), self.w_vs(enc)
        attn = torch.matmul(q / HIDDEN ** 0.5, k.transpose(1, 2))
        attn = F.softmax(attn.masked_fill(slf_attn_mask, -1e9), dim=-1)
        out = self.layer_norm(self.fc(torch.matmul(attn, v)) + enc)
        return out * non_pad_mask

    def forward(self, event_time, event_type):
        non_pad_mask = event_type.ne(0).float().unsqueeze(2)
        data = self.encode(event_type, event_time, non_pad_mask)
        type_mask = torch.zeros([*event_type.size(), self.num_types])
        for i in range(self.num_types):
            type_mask[:, :, i] = (event_type == i + 1).float()
        all_lambda = softplus(self.linear(data), self.beta, self.threshold)
        type_lambda = torch.sum(all_lambda * type_mask, dim=2)
        event_ll = compute_event(type_lambda, non_pad_mask.squeeze(2), self.guard).sum(-1)
        non_event_ll = compute_integral_unbiased(self, data, event_time, non_pad_mask.squeeze(2),
                                                 type_mask).sum(-1)
        return event_ll, non_event_ll


def thp_loss(out, event_type):
    event_ll, non_event_ll = out
    return -torch.sum(event_ll - non_event_ll) / event_type.ne(0).sum()


def make_thp(**kw):
    torch.manual_seed(0)
    return THP(**kw)


# ---------------------------------------------------------------------------------------------
# LogNormMix (intensity-free)


class LogNormMix(nn.Module):
    def __init__(self, feature_eps=1e-8, floor=1e-10):
        super().__init__()
        self.mark_embedding = nn.Embedding(NUM_TYPES + 1, EMBED, padding_idx=0)
        self.rnn = nn.GRU(1 + EMBED, HIDDEN, batch_first=True)
        self.linear = nn.Linear(HIDDEN, 3 * MIX)
        self.register_buffer("mean_log_inter_time", torch.tensor(0.0))
        self.register_buffer("std_log_inter_time", torch.tensor(1.0))
        self.feature_eps, self.floor = feature_eps, floor

    def get_features(self, inter_times, marks):
        features = torch.log(inter_times + self.feature_eps).unsqueeze(-1)
        features = (features - self.mean_log_inter_time) / self.std_log_inter_time
        return torch.cat([features, self.mark_embedding(marks)], dim=-1)

    def get_context(self, features):
        context = self.rnn(features)[0]
        return F.pad(context[:, :-1], (0, 0, 1, 0))  # the history before each event

    def forward(self, arrival_times, marks, mask):
        inter_times = torch.diff(arrival_times, dim=1, prepend=torch.zeros_like(
            arrival_times[:, :1])) * mask
        context = self.get_context(self.get_features(inter_times, marks))
        raw = self.linear(context)
        locs = raw[..., :MIX]
        log_scales = raw[..., MIX:2 * MIX].clamp(-5.0, 3.0)
        log_weights = torch.log_softmax(raw[..., 2 * MIX:], dim=-1)
        if self.floor is None:  # torch.distributions' log-normal mixture, given the pads' 0
            return self.inter_time_dist(locs, log_scales, log_weights).log_prob(inter_times)
        y = torch.log(inter_times.clamp(self.floor)).unsqueeze(-1)
        z = (y - self.mean_log_inter_time) / self.std_log_inter_time
        normal = (-0.5 * ((z - locs) / log_scales.exp()) ** 2 - log_scales
                  - 0.5 * math.log(2 * math.pi))
        log_p = torch.logsumexp(log_weights + normal, dim=-1)
        return log_p - torch.log(self.std_log_inter_time) - y.squeeze(-1)

    def inter_time_dist(self, locs, log_scales, log_weights):
        """ifl-tpp's LogNormalMixtureDistribution, from torch.distributions' own parts."""
        gmm = D.MixtureSameFamily(D.Categorical(logits=log_weights),
                                  D.Normal(locs, log_scales.exp()))
        return D.TransformedDistribution(gmm, [
            D.AffineTransform(self.mean_log_inter_time, self.std_log_inter_time),
            D.ExpTransform()])


def lognormmix_loss(log_p, mask):
    return -(log_p * mask).sum() / mask.sum()


def make_lognormmix(**kw):
    torch.manual_seed(0)
    return LogNormMix(**kw)
