"""Full-waveform inversion, written as deepwave / the PyTorch FWI tutorials write it, for
``test_waveform_inversion``.

- ``Propagator``: a second-order finite-difference acoustic wave equation time-stepped in
  PyTorch: the 5-point Laplacian by ``conv2d``, a Cerjan sponge (``exp(-(a (nb - i))²)`` on
  the outer ``NB`` cells, applied to both time levels), a Ricker source injected at each
  shot's source cell, receivers on a row near the surface recording the wavefield.
- ``FWI``: the velocity model as an ``nn.Parameter`` bounded by a sigmoid reparametrisation
  (``vmin + (vmax - vmin) * sigmoid(theta)``), simulated for a batch of shots (one-hot source
  maps), with an optional mute mask of the near-offset traces passed into ``forward``.
- losses: L2 on traces (``nn.MSELoss``), normalized cross-correlation (each trace divided by
  its norm), an envelope misfit (the analytic signal by FFT, ``sqrt(re² + im²)``), a
  standardised-trace misfit (one-pass ``E[d²] - E[d]²``), and a Tikhonov smoothness wrapper.
- ``SlownessFWI``: the same, parametrised by squared slowness ``m = 1 / v²``, unbounded.
- field-data time steps (5, 8 ms) above the CFL limit, and wavefield snapshots kept in
  float16 for the illumination.
- ``illumination_precondition``: the gradient divided by the source illumination
  ``sum_t u²`` (a diagonal pseudo-Hessian), between ``backward`` and ``step``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

NZ, NX, NB = 20, 24, 4        # grid cells (the sponge included), sponge width
DX, DT, NT, F0 = 10.0, 1e-3, 60, 25.0
REC_Z, SRC_Z = 2, 1
VMIN, VMAX = 1500.0, 3500.0


def ricker(nt: int, dt: float, f0: float) -> torch.Tensor:
    t = torch.arange(nt, dtype=torch.float32) * dt - 1.2 / f0
    a = (math.pi * f0 * t) ** 2
    return (1 - 2 * a) * torch.exp(-a)


def sponge(nz: int, nx: int, nb: int, a: float = 0.08) -> torch.Tensor:
    """Cerjan's damping profile: 1 inside, exp(-(a (nb - i))²) across the absorbing band."""
    def profile(n):
        i = torch.arange(n, dtype=torch.float32)
        d = torch.clamp(torch.maximum(nb - i, i - (n - 1 - nb)), min=0)
        return torch.exp(-(a * d) ** 2)
    return profile(nz)[:, None] * profile(nx)[None, :]


class Propagator(nn.Module):
    """``u(t+dt) = 2u - u(t-dt) + (v dt/dx)² (∇²u + s w(t))``, sponge-damped, recorded on
    row ``REC_Z``; ``illum`` keeps ``sum_t u²`` of the last call (the pseudo-Hessian)."""

    def __init__(self, dt: float = DT, nt: int = NT, snapshot_dtype=torch.float32):
        super().__init__()
        self.dt, self.nt, self.snapshot_dtype = dt, nt, snapshot_dtype
        lap = torch.tensor([[0., 1., 0.], [1., -4., 1.], [0., 1., 0.]])
        self.register_buffer("stencil", lap.view(1, 1, 3, 3))
        self.register_buffer("damp", sponge(NZ, NX, NB))
        self.register_buffer("wavelet", ricker(nt, dt, F0))
        self.illum = None

    def forward(self, vel, src):  # vel (NZ, NX) m/s, src (B, NZ, NX) one-hot source maps
        r2 = (vel * self.dt / DX) ** 2
        src = src[:, None]
        u_prev = torch.zeros_like(src)
        u = torch.zeros_like(src)
        traces, illum = [], torch.zeros_like(vel)
        for it in range(self.nt):
            lap = F.conv2d(u, self.stencil, padding=1)
            u_next = 2 * u - u_prev + r2 * (lap + src * self.wavelet[it])
            u_prev, u = u * self.damp, u_next * self.damp
            traces.append(u[:, 0, REC_Z, :])
            snap = u.detach().to(self.snapshot_dtype)  # (the stored snapshot)
            illum = illum + (snap ** 2).sum((0, 1)).float()
        self.illum = illum
        return torch.stack(traces, 1)  # (B, NT, NX)


class FWI(nn.Module):
    """The velocity model, bounded by a sigmoid, simulated for a batch of shots."""

    def __init__(self, dt: float = DT, nt: int = NT, v0: torch.Tensor | None = None,
                 snapshot_dtype=torch.float32):
        super().__init__()
        v0 = smooth_model() if v0 is None else v0
        p = ((v0 - VMIN) / (VMAX - VMIN)).clamp(1e-3, 1 - 1e-3)
        self.theta = nn.Parameter(torch.log(p / (1 - p)))
        self.prop = Propagator(dt=dt, nt=nt, snapshot_dtype=snapshot_dtype)

    def velocity(self):
        return VMIN + (VMAX - VMIN) * torch.sigmoid(self.theta)

    def forward(self, src, mute=None):
        d = self.prop(self.velocity(), src)
        return d if mute is None else d * mute


class SlownessFWI(FWI):
    """The model as squared slowness ``m = 1 / v²`` (the wave equation's own parameter, which
    many FWI codes invert for), an unbounded ``nn.Parameter`` in s²/m²."""

    def __init__(self, dt: float = DT):
        super().__init__(dt=dt)
        del self.theta
        self.m = nn.Parameter(1.0 / smooth_model() ** 2)

    def velocity(self):
        return self.m.rsqrt()


def make_fwi_slowness():
    return SlownessFWI()


def smooth_model() -> torch.Tensor:
    """The starting model: velocity increasing with depth."""
    return torch.linspace(1800.0, 2600.0, NZ)[:, None].expand(NZ, NX).clone()


def true_model() -> torch.Tensor:
    v = smooth_model()
    v[9:13, 8:16] = 3000.0  # a fast lens
    return v


def make_fwi():
    return FWI()


def make_fwi_half_snapshots():
    """Wavefield snapshots kept in float16 to save memory (the illumination made of them)."""
    return FWI(snapshot_dtype=torch.float16)


def make_fwi_field_dt_5ms():
    """The time step taken from the field data's 5 ms sample interval, not from the CFL
    condition ``v_max dt / dx < 1/sqrt(2)`` (here up to 2600 * 5e-3 / 10 = 1.3)."""
    return FWI(dt=5e-3)


def make_fwi_field_dt_8ms():
    """The same mistake with an 8 ms sample interval: the wavefield overflows in forward."""
    return FWI(dt=8e-3)


# ---------------------------------------------------------------------------------------------
# data: shots, observed traces, mutes

N_SHOTS = 8


def source_maps(cols) -> torch.Tensor:
    s = torch.zeros(len(cols), NZ, NX)
    for k, c in enumerate(cols):
        s[k, SRC_Z, c] = 1.0
    return s


def shot_cols() -> list[int]:
    return torch.linspace(NB + 1, NX - NB - 2, N_SHOTS).round().long().tolist()


def observed(cols=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Source maps and the traces the true model records (the synthetic 'field data')."""
    src = source_maps(shot_cols() if cols is None else cols)
    with torch.no_grad():
        obs = FWI(v0=true_model())(src)
    return src, obs


def near_offset_mute(src: torch.Tensor, width: int = 2) -> torch.Tensor:
    """(B, 1, NX): 0 on the receivers within ``width`` columns of each shot's source."""
    col = src.sum(1).argmax(-1)
    rec = torch.arange(NX)
    return ((rec[None, :] - col[:, None]).abs() > width).float()[:, None, :]


def shot_loader(src, obs, *extra, batch_size: int = 4) -> DataLoader:
    return DataLoader(TensorDataset(src, obs, *extra), batch_size=batch_size, shuffle=False)


# ---------------------------------------------------------------------------------------------
# misfits

class NCCLoss(nn.Module):
    """1 - normalized cross-correlation of each trace with its observed trace."""

    def __init__(self, eps: float = 0.0):
        super().__init__()
        self.eps = eps

    def forward(self, pred, obs):  # (B, T, R)
        pn = pred / (pred.norm(dim=1, keepdim=True) + self.eps)
        on = obs / (obs.norm(dim=1, keepdim=True) + self.eps)
        return (1 - (pn * on).sum(1)).mean()


def envelope(d, eps: float = 0.0):
    """|analytic signal| along time, the Hilbert transform by FFT."""
    n = d.shape[1]
    h = torch.zeros(n, dtype=d.dtype)
    h[0] = 1
    h[1:(n + 1) // 2] = 2
    if n % 2 == 0:
        h[n // 2] = 1
    a = torch.fft.ifft(torch.fft.fft(d, dim=1) * h[:, None], dim=1)
    return torch.sqrt(a.real ** 2 + a.imag ** 2 + eps)


class EnvelopeLoss(nn.Module):
    def __init__(self, eps: float = 0.0):
        super().__init__()
        self.eps = eps

    def forward(self, pred, obs):
        return F.mse_loss(envelope(pred, self.eps), envelope(obs, self.eps))


class StandardisedTraceLoss(nn.Module):
    """L2 between traces standardised per trace (mean and std over time), the std in one
    pass as ``sqrt(E[d²] - E[d]²)``; ``two_pass`` centres first."""

    def __init__(self, two_pass: bool = False):
        super().__init__()
        self.two_pass = two_pass

    def standardise(self, d):
        m = d.mean(1, keepdim=True)
        if self.two_pass:
            std = (d - m).pow(2).mean(1, keepdim=True).sqrt()
        else:
            std = torch.sqrt((d * d).mean(1, keepdim=True) - m * m)
        return (d - m) / (std + 1e-6)

    def forward(self, pred, obs):
        return F.mse_loss(self.standardise(pred), self.standardise(obs))


class Regularised(nn.Module):
    """A loss wrapper adding Tikhonov smoothness of the model's velocity (first differences
    in both directions), ``loss(pred, obs) + lam * |∇v|²``."""

    def __init__(self, misfit: nn.Module, model: FWI, lam: float = 1e-9):
        super().__init__()
        self.misfit, self.lam = misfit, lam
        self.model = [model]  # not a submodule: the recorder records the model itself

    def forward(self, pred, obs):
        v = self.model[0].velocity()
        tik = (v.diff(dim=0) ** 2).mean() + (v.diff(dim=1) ** 2).mean()
        return self.misfit(pred, obs) + self.lam * tik


def illumination_precondition(model: FWI, eps: float | None = None) -> None:
    """Divide the gradient by the source illumination ``sum_t u²`` (normalised to its max),
    as a diagonal pseudo-Hessian; ``eps`` (a fraction of the max) keeps it away from 0."""
    illum = model.prop.illum / model.prop.illum.max()
    model.theta.grad /= illum if eps is None else illum + eps
