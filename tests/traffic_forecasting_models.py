"""Traffic forecasting models as the METR-LA / PEMS-BAY code writes them (DCRNN, Graph WaveNet,
STGCN and their ports), for ``test_traffic_forecasting``. A batch is ``(B, T, N, 1)`` speed
windows of N road sensors, z-scored by a per-sensor scaler; targets are raw speeds in mph with
0.0 for a missing reading (the loader's null value).

- ``DCRNN``: an encoder-decoder of DCGRU cells whose gates are diffusion convolutions over
  the forward and backward random-walk matrices ``D^-1 A`` and ``D^-1 A^T`` (K hops), built in
  ``forward`` from the adjacency buffer as STGCN/ASTGCN ports do; the decoder runs with
  scheduled sampling (teacher forcing with probability ``k / (k + exp(batches_seen / k))``,
  ``labels`` and ``batches_seen`` given to ``forward``).
- ``GraphWaveNet``: gated dilated temporal convolutions, graph convolutions over the fixed
  supports plus the adaptive adjacency ``softmax(relu(E1 E2^T))``, optionally sparsified to the
  positive entries (``masked_fill(-inf)`` before the softmax) or to each row's top k.
- ``STGCN``: a sandwich block (gated temporal conv, Chebyshev graph conv over the scaled
  Laplacian ``2 L / lambda_max - I``, lambda_max from ``eigvalsh``, temporal conv, LayerNorm).
- ``AttentionForecaster``: GMAN-like spatial attention over the sensors that reported at each
  time step (missing readings masked out of the keys, ``observed`` given to ``forward``), a GRU
  over time.
- ``masked_mae`` / ``masked_mape`` / ``masked_rmse``: DCRNN's metrics (``mask = (y != null)``,
  ``mask /= mask.mean()``, NaN guards), with a flag that leaves the guard out.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

SENSORS, T_IN, HORIZON = 6, 4, 3


# ---------------------------------------------------------------------------------------------
# The road graph and the scaler

def road_graph(isolated: int | None = None, self_loops: bool = True) -> torch.Tensor:
    """DCRNN's thresholded Gaussian kernel ``exp(-d^2 / sigma^2)`` of road distances, entries
    below 0.1 dropped. Sensor ``isolated`` lies far from every other (a new ramp detector), and
    without self-loops its row is all 0."""
    g = torch.Generator().manual_seed(7)
    pos = torch.rand(SENSORS, 2, generator=g) * 3
    if isolated is not None:
        pos[isolated] = 100.0
    d = torch.cdist(pos, pos)
    adj = torch.exp(-(d / d[d > 0].std()) ** 2)
    adj[adj < 0.1] = 0.0
    if not self_loops:
        adj.fill_diagonal_(0.0)
    return adj


def random_walk(adj: torch.Tensor, guard: bool) -> torch.Tensor:
    """``D^-1 A`` as DCRNN's ``calculate_random_walk_matrix``: its ``d_inv[isinf] = 0`` is the
    guard for a sensor of degree 0."""
    d_inv = adj.sum(1).pow(-1)
    if guard:
        d_inv = torch.where(torch.isinf(d_inv), torch.zeros_like(d_inv), d_inv)
    return d_inv[:, None] * adj


class StandardScaler:
    """The loaders' z-score, per sensor, fitted on the training split."""

    def __init__(self, data: torch.Tensor, eps: float = 0.0):  # data (T, N); x (..., N, 1)
        self.mean, self.std = data.mean(0)[:, None], data.std(0)[:, None] + eps

    def transform(self, x):
        return (x - self.mean) / self.std

    def inverse_transform(self, x):
        return x * self.std + self.mean


# ---------------------------------------------------------------------------------------------
# DCRNN

class DiffusionConv(nn.Module):
    """Sum over supports and hops k of ``P^k X W``, Chebyshev-like recursion as DCRNN's
    ``_gconv``."""

    def __init__(self, n_in: int, n_out: int, hops: int = 2, supports: int = 2):
        super().__init__()
        self.hops = hops
        self.lin = nn.Linear(n_in * (1 + supports * hops), n_out)

    def forward(self, x, supports):  # x (B, N, F)
        feats = [x]
        for p in supports:
            x0, x1 = x, torch.einsum("nm,bmf->bnf", p, x)
            feats.append(x1)
            for _ in range(2, self.hops + 1):
                x2 = 2 * torch.einsum("nm,bmf->bnf", p, x1) - x0
                feats.append(x2)
                x0, x1 = x1, x2
        return self.lin(torch.cat(feats, -1))


class DCGRUCell(nn.Module):
    def __init__(self, n_in: int, hidden: int):
        super().__init__()
        self.gates = DiffusionConv(n_in + hidden, 2 * hidden)
        self.cand = DiffusionConv(n_in + hidden, hidden)
        self.hidden = hidden

    def forward(self, x, h, supports):
        r, u = torch.sigmoid(self.gates(torch.cat([x, h], -1), supports)).chunk(2, -1)
        c = torch.tanh(self.cand(torch.cat([x, r * h], -1), supports))
        return u * h + (1 - u) * c


class DCRNN(nn.Module):
    def __init__(self, adj: torch.Tensor, hidden: int = 8, guard: bool = True,
                 cl_decay_steps: float = 2.0, learn_edges: bool = False):
        super().__init__()
        self.register_buffer("adj", adj)
        # learned weights of the road graph's edges (a zero entry of adj stays no edge)
        self.edge_weight = nn.Parameter(torch.full_like(adj, 0.5)) if learn_edges else None
        self.encoder, self.decoder = DCGRUCell(1, hidden), DCGRUCell(1, hidden)
        self.proj = nn.Linear(hidden, 1)
        self.guard, self.cl_decay_steps, self.hidden = guard, cl_decay_steps, hidden

    def teacher_forcing(self, batches_seen: int) -> float:
        k = self.cl_decay_steps
        return k / (k + math.exp(batches_seen / k))

    def forward(self, x, labels=None, batches_seen: int = 0):  # x (B, T, N, 1)
        adj = self.adj if self.edge_weight is None else self.adj * F.softplus(self.edge_weight)
        supports = [random_walk(adj, self.guard), random_walk(adj.T, self.guard)]
        b, _, n, _ = x.shape
        h = x.new_zeros(b, n, self.hidden)
        for t in range(x.shape[1]):
            h = self.encoder(x[:, t], h, supports)
        go, outs = x.new_zeros(b, n, 1), []
        for t in range(HORIZON):
            h = self.decoder(go, h, supports)
            out = self.proj(h)
            outs.append(out)
            go = out
            if self.training and labels is not None:
                if torch.rand(()) < self.teacher_forcing(batches_seen):
                    go = labels[:, t]
        return torch.stack(outs, 1)  # (B, HORIZON, N, 1), z-scored


def make_dcrnn() -> DCRNN:
    return DCRNN(road_graph())


def make_dcrnn_isolated() -> DCRNN:
    """A graph rebuilt without self-loops after a ramp detector far from the rest was added,
    and ``random_walk`` written without DCRNN's ``d_inv[isinf] = 0``."""
    return DCRNN(road_graph(isolated=4, self_loops=False), guard=False)


def make_dcrnn_isolated_guarded() -> DCRNN:
    return DCRNN(road_graph(isolated=4, self_loops=False), guard=True)


def make_dcrnn_learned_edges() -> DCRNN:
    """Learned edge weights on the graph with the isolated detector, DCRNN's guard kept: the
    forward is finite, the degree's pow(-1) is +inf at the isolated row."""
    return DCRNN(road_graph(isolated=4, self_loops=False), guard=True, learn_edges=True)


def make_dcrnn_learned_edges_clamped() -> DCRNN:
    """The same with self-loops kept: no degree is 0."""
    return DCRNN(road_graph(isolated=4), guard=True, learn_edges=True)


# ---------------------------------------------------------------------------------------------
# Graph WaveNet

class GraphConv(nn.Module):
    def __init__(self, channels: int, supports: int, order: int = 2):
        super().__init__()
        self.order = order
        self.mlp = nn.Conv2d(channels * (1 + supports * order), channels, 1)

    def forward(self, x, supports):  # x (B, C, N, T)
        out = [x]
        for a in supports:
            x1 = torch.einsum("bcnt,nm->bcmt", x, a)
            out.append(x1)
            for _ in range(2, self.order + 1):
                x1 = torch.einsum("bcnt,nm->bcmt", x1, a)
                out.append(x1)
        return self.mlp(torch.cat(out, 1))


class GraphWaveNet(nn.Module):
    def __init__(self, adj: torch.Tensor, channels: int = 8, emb: int = 4,
                 sparsify: str | None = None, topk: int = 2, zero_sensor: int | None = None):
        super().__init__()
        self.register_buffer("fwd", random_walk(adj, guard=True))
        self.register_buffer("bwd", random_walk(adj.T, guard=True))
        self.nodevec1 = nn.Parameter(torch.randn(SENSORS, emb))
        self.nodevec2 = nn.Parameter(torch.randn(emb, SENSORS))
        if zero_sensor is not None:  # a detector added to a trained network, its row at 0
            with torch.no_grad():
                self.nodevec1[zero_sensor] = 0.0
        self.start = nn.Conv2d(1, channels, 1)
        self.filt = nn.ModuleList(nn.Conv2d(channels, channels, (1, 2), dilation=d) for d in (1, 2))
        self.gate = nn.ModuleList(nn.Conv2d(channels, channels, (1, 2), dilation=d) for d in (1, 2))
        self.gconv = nn.ModuleList(GraphConv(channels, 3) for _ in range(2))
        self.bn = nn.ModuleList(nn.BatchNorm2d(channels) for _ in range(2))
        self.end = nn.Conv2d(channels, HORIZON, (1, 1))
        self.sparsify, self.topk = sparsify, topk

    def adaptive(self):
        adp = F.relu(self.nodevec1 @ self.nodevec2)
        if self.sparsify == "positive":  # keep the learned edges only
            adp = adp.masked_fill(adp <= 0, float("-inf"))
        elif self.sparsify == "walk":  # MTGNN-like: the learned graph normalised as D^-1 A
            return random_walk(adp, guard=True)
        elif self.sparsify == "topk":  # each row's k strongest edges
            kth = adp.topk(self.topk, dim=1).values[:, -1:]
            adp = adp.masked_fill(adp < kth, float("-inf"))
        return F.softmax(adp, dim=1)

    def forward(self, x):  # x (B, T, N, 1) -> (B, HORIZON, N, 1)
        supports = [self.fwd, self.bwd, self.adaptive()]
        x = self.start(x.permute(0, 3, 2, 1))  # (B, C, N, T)
        for filt, gate, gconv, bn in zip(self.filt, self.gate, self.gconv, self.bn):
            res = x
            x = torch.tanh(filt(x)) * torch.sigmoid(gate(x))
            x = gconv(x, supports) + res[..., -x.shape[-1]:]
            x = bn(x)
        return self.end(F.relu(x[..., -1:]))  # (B, HORIZON, N, 1)


def make_gwnet() -> GraphWaveNet:
    torch.manual_seed(3)
    return GraphWaveNet(road_graph(), sparsify="topk")


def make_gwnet_positive() -> GraphWaveNet:
    """Sparsified to the positive entries, with a new detector's embedding added at 0."""
    torch.manual_seed(3)
    return GraphWaveNet(road_graph(), sparsify="positive", zero_sensor=2)


def make_gwnet_walk() -> GraphWaveNet:
    """The adaptive adjacency normalised by its degree (guarded as DCRNN guards it) instead of
    a softmax, with the new detector's embedding at 0: its degree is 0."""
    torch.manual_seed(3)
    return GraphWaveNet(road_graph(), sparsify="walk", zero_sensor=2)


def make_gwnet_topk_new_sensor() -> GraphWaveNet:
    """The same new detector under a top-k sparsification: every row keeps k entries."""
    torch.manual_seed(3)
    return GraphWaveNet(road_graph(), sparsify="topk", zero_sensor=2)


# ---------------------------------------------------------------------------------------------
# STGCN (Chebyshev graph convolution)

def scaled_laplacian(adj: torch.Tensor, guard: bool) -> torch.Tensor:
    """STGCN's ``2 L / lambda_max - I`` of the normalised Laplacian ``I - D^-1/2 A D^-1/2``."""
    d_is = adj.sum(1).pow(-0.5)
    if guard:
        d_is = torch.where(torch.isinf(d_is), torch.zeros_like(d_is), d_is)
    eye = torch.eye(adj.shape[0], dtype=adj.dtype)
    lap = eye - d_is[:, None] * adj * d_is[None, :]
    lam = torch.linalg.eigvalsh(lap).max()
    return 2 * lap / lam - eye


class STGCN(nn.Module):
    """A sandwich block: gated temporal conv, Chebyshev graph conv (K = 3), temporal conv."""

    def __init__(self, adj: torch.Tensor, channels: int = 8, guard: bool = True):
        super().__init__()
        self.register_buffer("adj", adj)
        self.guard = guard
        self.tconv1 = nn.Conv2d(1, 2 * channels, (2, 1))
        self.theta = nn.Linear(3 * channels, channels)
        self.tconv2 = nn.Conv2d(channels, channels, (2, 1))
        self.norm = nn.LayerNorm([SENSORS, channels])
        self.head = nn.Linear(channels * (T_IN - 2), HORIZON)

    def forward(self, x):  # x (B, T, N, 1)
        lap = scaled_laplacian(self.adj, self.guard)
        p, q = self.tconv1(x.permute(0, 3, 1, 2)).chunk(2, 1)  # GLU: (B, C, T-1, N)
        h = (p * torch.sigmoid(q)).permute(0, 2, 3, 1)  # (B, T-1, N, C)
        t1 = lap @ h
        t2 = 2 * (lap @ t1) - h
        h = torch.relu(self.theta(torch.cat([h, t1, t2], -1)))
        h = torch.relu(self.tconv2(h.permute(0, 3, 1, 2))).permute(0, 2, 3, 1)  # (B, T-2, N, C)
        h = self.norm(h).permute(0, 2, 1, 3).flatten(2)  # (B, N, (T-2) C)
        return self.head(h).transpose(1, 2)[..., None]


def make_stgcn() -> STGCN:
    torch.manual_seed(4)
    return STGCN(road_graph())


def make_stgcn_isolated() -> STGCN:
    torch.manual_seed(4)
    return STGCN(road_graph(isolated=4, self_loops=False), guard=False)


# ---------------------------------------------------------------------------------------------
# Spatial attention over the sensors that reported (GMAN/ASTGCN-like)

class SpatialAttention(nn.Module):
    """Each sensor attends to the sensors that reported at the same time step: a missing
    reading (0.0 raw, given to ``forward`` as ``observed``) is masked out of the keys."""

    def __init__(self, dim: int = 8, fill: float = float("-inf")):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.fill = fill

    def forward(self, h, observed):  # h (B, T, N, D), observed (B, T, N)
        q, k, v = self.qkv(h).chunk(3, -1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, T, N, N)
        scores = scores.masked_fill(~observed[:, :, None, :], self.fill)
        return h + torch.softmax(scores, -1) @ v


class AttentionForecaster(nn.Module):
    def __init__(self, dim: int = 8, fill: float = float("-inf")):
        super().__init__()
        self.embed = nn.Linear(1, dim)
        self.spatial = SpatialAttention(dim, fill)
        self.temporal = nn.GRU(dim, dim, batch_first=True)
        self.head = nn.Linear(dim, HORIZON)

    def forward(self, x, observed):  # x (B, T, N, 1) z-scored
        b, t, n, _ = x.shape
        h = self.spatial(self.embed(x), observed)
        _, last = self.temporal(h.permute(0, 2, 1, 3).reshape(b * n, t, -1))
        return self.head(last[-1]).reshape(b, n, HORIZON).transpose(1, 2)[..., None]


def make_attention() -> AttentionForecaster:
    torch.manual_seed(5)
    return AttentionForecaster()


def make_attention_finite_fill() -> AttentionForecaster:
    """The keys masked with a large finite negative: an all-missing time step averages every
    sensor's value instead of making NaN."""
    torch.manual_seed(5)
    return AttentionForecaster(fill=-1e9)


# ---------------------------------------------------------------------------------------------
# The masked losses (DCRNN's lib/metrics.py in torch)

def masked_mae(preds, labels, null_val: float = 0.0, guard: bool = True):
    if math.isnan(null_val):
        mask = ~torch.isnan(labels)
    else:
        mask = labels != null_val
    mask = mask.float()
    mask = mask / torch.mean(mask)  # 0/0 on a batch with no reading: the guard below
    if guard:
        mask = torch.where(torch.isnan(mask), torch.zeros_like(mask), mask)
    loss = torch.abs(preds - labels) * mask
    if guard:
        loss = torch.where(torch.isnan(loss), torch.zeros_like(loss), loss)
    return torch.mean(loss)


def masked_mape(preds, labels, null_val: float = 0.0):
    if math.isnan(null_val):
        mask = ~torch.isnan(labels)
    else:
        mask = labels != null_val
    mask = mask.float()
    mask = mask / torch.mean(mask)
    mask = torch.where(torch.isnan(mask), torch.zeros_like(mask), mask)
    loss = torch.abs(preds - labels) / labels
    loss = loss * mask
    loss = torch.where(torch.isnan(loss), torch.zeros_like(loss), loss)
    return torch.mean(loss)


def masked_mse(preds, labels, null_val: float = 0.0):
    mask = (labels != null_val).float()
    mask = mask / torch.mean(mask)
    mask = torch.where(torch.isnan(mask), torch.zeros_like(mask), mask)
    loss = (preds - labels) ** 2 * mask
    loss = torch.where(torch.isnan(loss), torch.zeros_like(loss), loss)
    return torch.mean(loss)


def masked_rmse(preds, labels, null_val: float = 0.0):
    return torch.sqrt(masked_mse(preds, labels, null_val))


def unguarded_mae(preds, labels):
    return masked_mae(preds, labels, guard=False)


def mae_plus_mape_nan_null(preds, labels):
    """MAE for the gradient plus 0.1 MAPE, the MAPE called with Graph WaveNet's default
    ``null_val=np.nan``: a reading stored as 0.0 is not masked."""
    return masked_mae(preds, labels) + 0.1 * masked_mape(preds, labels, null_val=float("nan"))


# ---------------------------------------------------------------------------------------------
# Data: speeds with a daily profile, 0.0 where a loop detector dropped out

def speeds(steps: int, g: torch.Generator) -> torch.Tensor:
    """(steps, N) speeds in mph: free flow minus a rush-hour dip, per-sensor noise."""
    t = torch.arange(steps, dtype=torch.float32)[:, None]
    base = 55 + 10 * torch.rand(1, SENSORS, generator=g)
    dip = 20 * torch.exp(-((t % 24 - 8) / 2) ** 2)
    return base - dip + 2 * torch.randn(steps, SENSORS, generator=g)


def windows(series: torch.Tensor):
    """The sliding windows ``(x, y)`` of DCRNN's ``generate_training_data``: (S, T, N, 1)."""
    n = series.shape[0] - T_IN - HORIZON + 1
    x = torch.stack([series[i:i + T_IN] for i in range(n)])[..., None]
    y = torch.stack([series[i + T_IN:i + T_IN + HORIZON] for i in range(n)])[..., None]
    return x, y
