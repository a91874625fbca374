"""Global weather forecasters written as FourCastNet, GraphCast and WeatherBench code writes them
(``tests/test_weather.py``): fields on a regular lat-lon grid normalised per channel by
statistics of the data, an AFNO block (rfft2, block-diagonal complex MLP, soft-shrink of the
spectrum, irfft2), a land-sea mask passed to ``forward``, a latitude-weighted MSE, and a message-passing
mesh with edge lengths as features."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

H, W, C = 8, 16, 4  # latitude rows, longitude columns, channels (z500, t850, u10, precip)


def latitudes(h: int = H) -> torch.Tensor:
    """Cell-centre latitudes in degrees, north to south, as ERA5 regridded to ``h`` rows."""
    return torch.linspace(90 - 90 / h, -90 + 90 / h, h)


def lat_weights(h: int = H) -> torch.Tensor:
    """WeatherBench's cos(lat) weights normalised by their mean, shaped to broadcast (H, 1)."""
    w = torch.cos(torch.deg2rad(latitudes(h)))
    return (w / w.mean()).unsqueeze(-1)


class LatWeightedMSE(nn.Module):
    """WeatherBench's ``mean(w_lat * (pred - y)**2)``."""

    def __init__(self, h: int = H):
        super().__init__()
        self.register_buffer("w", lat_weights(h))

    def forward(self, pred, y):
        return (self.w * (pred - y) ** 2).mean()


class AFNO2D(nn.Module):
    """FourCastNet's adaptive Fourier neural operator mixer: rfft2 over the grid, a two-layer
    block-diagonal MLP on the kept modes with real and imaginary weights, a soft-shrink that
    sparsifies the spectrum, irfft2 back, plus the residual."""

    def __init__(self, dim: int, blocks: int = 2, keep: float = 1.0, shrink: float = 0.01):
        super().__init__()
        self.blocks, self.bs, self.keep, self.shrink = blocks, dim // blocks, keep, shrink
        s = 0.02
        self.w1 = nn.Parameter(s * torch.randn(2, blocks, self.bs, self.bs))
        self.b1 = nn.Parameter(s * torch.randn(2, blocks, self.bs))
        self.w2 = nn.Parameter(s * torch.randn(2, blocks, self.bs, self.bs))
        self.b2 = nn.Parameter(s * torch.randn(2, blocks, self.bs))

    @staticmethod
    def _mul(x, w):
        return torch.einsum("...bi,bio->...bo", x, w)

    def forward(self, x):  # x: (B, H, W, dim)
        bias, dtype = x, x.dtype
        x = x.float()  # cuFFT has no bfloat16: FourCastNet casts up for the transform
        B, h, w, _ = x.shape
        x = torch.fft.rfft2(x, dim=(1, 2), norm="ortho")
        x = x.reshape(B, h, w // 2 + 1, self.blocks, self.bs)
        kept = int((w // 2 + 1) * self.keep)
        re, im = x.real[:, :, :kept], x.imag[:, :, :kept]
        o1r = F.relu(self._mul(re, self.w1[0]) - self._mul(im, self.w1[1]) + self.b1[0])
        o1i = F.relu(self._mul(im, self.w1[0]) + self._mul(re, self.w1[1]) + self.b1[1])
        o2r = self._mul(o1r, self.w2[0]) - self._mul(o1i, self.w2[1]) + self.b2[0]
        o2i = self._mul(o1i, self.w2[0]) + self._mul(o1r, self.w2[1]) + self.b2[1]
        z = F.softshrink(torch.stack([o2r, o2i], dim=-1), lambd=self.shrink)
        out = torch.zeros(B, h, w // 2 + 1, self.blocks, self.bs, dtype=torch.cfloat,
                          device=x.device)
        out[:, :, :kept] = torch.view_as_complex(z.contiguous())
        x = torch.fft.irfft2(out.reshape(B, h, w // 2 + 1, -1), s=(h, w), dim=(1, 2), norm="ortho")
        return x.type(dtype) + bias


class Normalize(nn.Module):
    """Per-channel z-score with the training set's statistics (buffers the data module computed
    once); the precipitation channel is ``log(p + eps)`` first, as its distribution is skewed
    (or ``p ** power``: the fourth root of nowcasting code)."""

    def __init__(self, mean, std, log_channel: int | None = 3, eps: float = 1e-5,
                 power: float | None = None):
        super().__init__()
        self.register_buffer("mean", mean.reshape(1, -1, 1, 1))
        self.register_buffer("std", std.reshape(1, -1, 1, 1))
        self.log_channel, self.eps, self.power = log_channel, eps, power

    def forward(self, x):
        if self.log_channel is not None:
            k = self.log_channel
            x = torch.cat([x[:, :k], transform(x[:, k:k + 1], self.eps, self.power),
                           x[:, k + 1:]], dim=1)
        return (x - self.mean) / self.std


def transform(p: torch.Tensor, eps: float, power: float | None) -> torch.Tensor:
    return torch.log(p + eps) if power is None else p.clamp_min(0) ** power


def channel_stats(data: torch.Tensor, log_channel: int | None = 3, eps: float = 1e-5,
                  power: float | None = None):
    """Per-channel mean and std over time, latitude and longitude of ``data`` (T, C, H, W)."""
    if log_channel is not None:
        data = data.clone()
        data[:, log_channel] = transform(data[:, log_channel], eps, power)
    return data.mean(dim=(0, 2, 3)), data.std(dim=(0, 2, 3))


class Forecaster(nn.Module):
    """Normalise, embed (the land-sea mask enters as an extra channel, as a static field does
    in FourCastNet: ``forward(x, lsm)``), AFNO blocks with a channel MLP, a head predicting the
    normalised tendency; returns the next state in physical units."""

    def __init__(self, mean, std, c: int = C, dim: int = 16, depth: int = 2,
                 log_channel: int | None = 3, power: float | None = None, **afno):
        super().__init__()
        self.normalize = Normalize(mean, std, log_channel, power=power)
        self.embed = nn.Conv2d(c + 1, dim, 1)
        self.mixers = nn.ModuleList([AFNO2D(dim, **afno) for _ in range(depth)])
        self.norms = nn.ModuleList([nn.LayerNorm(dim) for _ in range(depth)])
        self.mlps = nn.ModuleList([nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(),
                                                 nn.Linear(2 * dim, dim)) for _ in range(depth)])
        self.head = nn.Conv2d(dim, c, 1)

    def forward(self, x, lsm):
        z = self.normalize(x)
        h = torch.cat([z, lsm.expand(x.shape[0], 1, -1, -1).to(z.dtype)], dim=1)
        h = self.embed(h).permute(0, 2, 3, 1)
        for mix, norm, mlp in zip(self.mixers, self.norms, self.mlps):
            h = mix(norm(h))
            h = h + mlp(h)
        dz = self.head(h.permute(0, 3, 1, 2))
        out = x + (dz * self.normalize.std).float()
        if self.normalize.power is None:
            return out
        k = self.normalize.log_channel  # (precipitation is never negative: clamp the forecast)
        return torch.cat([out[:, :k], F.relu(out[:, k:k + 1]), out[:, k + 1:]], dim=1)


def training_data(regridded: bool = False) -> torch.Tensor:
    """48 hours of states; ``regridded``: as bilinear interpolation to the model grid leaves
    precipitation, with small negative values where it undershoots beside a dry cell (the
    training pipeline clamps them; a statistics script run on the raw files does not)."""
    return era5(48, seed=0, clamp=not regridded)


def make_forecaster(log_channel: int | None = 3, raw_stats: bool = False,
                    power: float | None = None, **afno) -> nn.Module:
    """``raw_stats``: the normalisation's statistics computed from the regridded files;
    ``power``: precipitation as ``p ** power``, its forecast clamped at 0."""
    mean, std = channel_stats(training_data(regridded=raw_stats), log_channel, power=power)
    torch.manual_seed(0)
    return Forecaster(mean, std, log_channel=log_channel, power=power, **afno)


def land_sea_mask(h: int = H, w: int = W) -> torch.Tensor:
    """1 over land: two blocky continents."""
    m = torch.zeros(h, w)
    m[1:4, 2:6] = 1
    m[4:7, 9:14] = 1
    return m


def era5(n: int, seed: int = 0, h: int = H, w: int = W, clamp: bool = True) -> torch.Tensor:
    """``n + 1`` consecutive synthetic states (z500-like waves, temperature, wind, precip >= 0)
    advected eastwards, so each state predicts the next."""
    g = torch.Generator().manual_seed(seed)
    lat = torch.deg2rad(latitudes(h)).reshape(-1, 1)
    lon = torch.linspace(0, 2 * math.pi, w + 1)[:-1].reshape(1, -1)
    phase = torch.rand(4, generator=g) * 2 * math.pi
    out = []
    for t in range(n + 1):
        s = 0.3 * t
        z = 5500 + 100 * torch.cos(lat) * torch.sin(2 * lon - s + phase[0])
        tt = 280 + 20 * torch.cos(lat) + 3 * torch.sin(lon - s + phase[1])
        u = 10 * torch.sin(2 * lat) + 2 * torch.cos(3 * lon - s + phase[2])
        p = F.relu(torch.sin(lon * 2 - s + phase[3]) * torch.cos(lat)) * 1e-3
        out.append(torch.stack([z, tt, u, p]) + 0.01 * torch.randn(4, h, w, generator=g))
    out = torch.stack(out)
    if clamp:
        out[:, 3].clamp_(min=0)  # precipitation is never negative in the archive
    return out


# ---------------------------------------------------------------------------------------------
# a mesh graph network


def icosphere_mesh(duplicate: bool = False):
    """The 12 vertices of an icosahedron (on the unit sphere) and its 60 directed edges; with
    ``duplicate``, one vertex is added twice, as a refinement that computes a shared midpoint
    from each of its faces without merging them does: a zero-length edge between the copies."""
    p = (1 + 5 ** 0.5) / 2
    v = torch.tensor([[-1, p, 0], [1, p, 0], [-1, -p, 0], [1, -p, 0], [0, -1, p], [0, 1, p],
                      [0, -1, -p], [0, 1, -p], [p, 0, -1], [p, 0, 1], [-p, 0, -1], [-p, 0, 1]])
    v = v / v.norm(dim=1, keepdim=True)
    d = torch.cdist(v, v)
    src, dst = torch.nonzero((d > 0) & (d < 1.1), as_tuple=True)
    if duplicate:
        v = torch.cat([v, v[:1]])
        n = v.shape[0] - 1
        src, dst = torch.cat([src, torch.tensor([0, n])]), torch.cat([dst, torch.tensor([n, 0])])
    return v, torch.stack([src, dst])


class MeshProcessor(nn.Module):
    """GraphCast's processor: edge features ``[length, displacement / length]`` made from the
    mesh positions, messages ``MLP([h_src, h_dst, e])`` summed onto receivers with
    ``index_add``/``scatter_add`` and averaged by in-degree, residual node updates."""

    def __init__(self, dim: int = 16, layers: int = 2, duplicate: bool = False):
        super().__init__()
        pos, edges = icosphere_mesh(duplicate)
        self.register_buffer("pos", pos)
        self.register_buffer("edges", edges)
        self.encode = nn.Linear(C, dim)
        self.edge_mlps = nn.ModuleList([nn.Sequential(nn.Linear(2 * dim + 4, dim), nn.SiLU())
                                        for _ in range(layers)])
        self.node_mlps = nn.ModuleList([nn.Linear(2 * dim, dim) for _ in range(layers)])
        self.decode = nn.Linear(dim, C)

    def edge_features(self, edges):
        src, dst = edges
        disp = self.pos[dst] - self.pos[src]
        length = disp.norm(dim=-1, keepdim=True)
        return torch.cat([length, disp / length], dim=-1)

    def forward(self, x, edges=None):
        """``x`` (B, N, C): the grid already mapped onto the mesh nodes; ``edges``: the mesh's
        ``(2, E)`` edge list when the data module passes it, else the model's own."""
        edges = self.edges if edges is None else edges
        src, dst = edges
        e = self.edge_features(edges)
        h = self.encode(x)
        deg = torch.zeros(h.shape[1]).index_add_(0, dst, torch.ones(dst.shape[0]))
        for edge_mlp, node_mlp in zip(self.edge_mlps, self.node_mlps):
            msg = edge_mlp(torch.cat([h[:, src], h[:, dst], e.expand(h.shape[0], -1, -1)], -1))
            agg = torch.zeros_like(h).scatter_add_(1, dst.reshape(1, -1, 1).expand_as(msg), msg)
            h = h + node_mlp(torch.cat([h, agg / deg.reshape(1, -1, 1)], -1))
        return x + self.decode(h)


def make_mesh(duplicate: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return MeshProcessor(duplicate=duplicate)
