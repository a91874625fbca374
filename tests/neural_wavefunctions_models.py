"""Neural network wavefunctions written by hand as FermiNet, PauliNet and DeepErwin write them,
for ``test_neural_wavefunctions``.

- ``FermiNet``: electron-nucleus vectors and hand-written distances as one-electron features,
  the mean over each spin channel as the permutation-equivariant layer, ``n_det`` orbital
  matrices per spin times an exponential envelope, ``log|psi|`` by ``torch.linalg.slogdet``
  and a signed logsumexp over the determinants.
- ``local_energy``: the kinetic term from the Laplacian of ``log|psi|`` by double backward
  (``create_graph=True``), plus the 1/r Coulomb potentials.
- ``metropolis``: Gaussian proposals from a ``torch.Generator``, acceptance by the
  log-probability ratio ``2 (log|psi'| - log|psi|)``; ``reset_outliers``: walkers that drifted
  past a cutoff put back on the nucleus (every electron at the same point).
- ``vmc_loss`` / ``vmc_loss_tanh``: VMC's loss with the local energy clipped around its median
  by ``k`` mean absolute deviations (a hard clamp; DeepErwin's tanh clipping).
"""

from __future__ import annotations

import torch
from torch import nn

N_UP, N_DOWN = 2, 1
N_EL = N_UP + N_DOWN
Z = 3.0  # lithium at the origin


def pair_dist(a, b):
    """|a_i - b_j| written by hand, as most ports of FermiNet do."""
    return ((a[..., :, None, :] - b[..., None, :, :]) ** 2).sum(-1).sqrt()


class FermiNet(nn.Module):
    def __init__(self, hidden: int = 32, n_det: int = 4):
        super().__init__()
        self.register_buffer("nuclei", torch.zeros(1, 3))
        self.n_det = n_det
        self.one = nn.Linear(4, hidden)
        self.mix = nn.Linear(3 * hidden, hidden)
        self.orb_up = nn.Linear(hidden, n_det * N_UP)
        self.orb_down = nn.Linear(hidden, n_det * N_DOWN)
        self.sigma = nn.Parameter(torch.ones(n_det))

    def forward(self, r):  # r: (B, N_EL, 3)
        r_ei = r[:, :, None, :] - self.nuclei  # (B, N_EL, 1, 3)
        d_ei = pair_dist(r, self.nuclei)  # (B, N_EL, 1)
        h = torch.tanh(self.one(torch.cat([r_ei[:, :, 0], d_ei], -1)))
        g_up = h[:, :N_UP].mean(1, keepdim=True).expand_as(h)
        g_down = h[:, N_UP:].mean(1, keepdim=True).expand_as(h)
        h = h + torch.tanh(self.mix(torch.cat([h, g_up, g_down], -1)))
        env = torch.exp(-d_ei * self.sigma.abs())  # (B, N_EL, n_det)
        b = r.shape[0]
        up = (self.orb_up(h[:, :N_UP]).view(b, N_UP, self.n_det, N_UP)
              * env[:, :N_UP, :, None]).permute(0, 2, 1, 3)
        down = (self.orb_down(h[:, N_UP:]).view(b, N_DOWN, self.n_det, N_DOWN)
                * env[:, N_UP:, :, None]).permute(0, 2, 1, 3)
        s_up, ld_up = torch.linalg.slogdet(up)
        s_down, ld_down = torch.linalg.slogdet(down)
        logabs = ld_up + ld_down  # (B, n_det)
        sign = s_up * s_down
        top = logabs.max(-1, keepdim=True).values  # signed logsumexp over determinants
        return top[:, 0] + torch.log((sign * torch.exp(logabs - top)).sum(-1).abs())


def make_ferminet() -> FermiNet:
    torch.manual_seed(0)
    return FermiNet()


def potential(r, nuclei):
    r_ee = pair_dist(r, r)
    iu = torch.triu_indices(N_EL, N_EL, 1)
    v_ee = (1.0 / r_ee[:, iu[0], iu[1]]).sum(-1)
    v_en = -(Z / pair_dist(r, nuclei)).sum((-1, -2))
    return v_ee + v_en


def local_energy(model, r):
    """E_L = -1/2 (lap log|psi| + |grad log|psi||^2) + V, the Laplacian by double backward."""
    r = r.detach().requires_grad_(True)
    logpsi = model(r)
    (grad,) = torch.autograd.grad(logpsi.sum(), r, create_graph=True)
    flat = grad.reshape(r.shape[0], -1)
    lap = torch.zeros(r.shape[0], dtype=r.dtype)
    for i in range(flat.shape[1]):
        (g2,) = torch.autograd.grad(flat[:, i].sum(), r, retain_graph=True)
        lap = lap + g2.reshape(r.shape[0], -1)[:, i]
    kinetic = -0.5 * (lap + (flat ** 2).sum(-1))
    return (kinetic + potential(r, model.nuclei)).detach()


@torch.no_grad()
def metropolis(model, r, g: torch.Generator, steps: int = 3, width: float = 0.3):
    logp = 2 * model(r)
    for _ in range(steps):
        prop = r + width * torch.randn(r.shape, generator=g)
        logp_new = 2 * model(prop)
        accept = torch.rand(r.shape[0], generator=g).log() < logp_new - logp
        r = torch.where(accept[:, None, None], prop, r)
        logp = torch.where(accept, logp_new, logp)
    return r


def init_walkers(g: torch.Generator, n: int = 16):
    return torch.randn(n, N_EL, 3, generator=g)


def reset_outliers(r, nuclei, cutoff: float = 20.0):
    """The bug: a walker that drifted past the cutoff is put back exactly on the nucleus, all
    its electrons at one point (no Gaussian spread)."""
    far = r.norm(dim=-1).amax(-1) > cutoff
    return torch.where(far[:, None, None], nuclei[0].expand_as(r), r)


def clip_window(e_loc, k: float = 5.0):
    med = e_loc.median()
    return med, k * (e_loc - med).abs().mean()


def vmc_loss(logpsi, e_loc):
    """FermiNet's clipped VMC loss: E_L clamped to median +- k * MAD, centred, detached."""
    med, width = clip_window(e_loc)
    e = e_loc.clamp(med - width, med + width)
    return 2 * ((e - e.mean()).detach() * logpsi).mean()


def vmc_loss_tanh(logpsi, e_loc):
    """DeepErwin's smooth clipping: median + width * tanh((E_L - median) / width)."""
    med, width = clip_window(e_loc)
    e = med + width * torch.tanh((e_loc - med) / width)
    return 2 * ((e - e.mean()).detach() * logpsi).mean()


def make_ferminet64() -> FermiNet:
    """In float64, as most VMC codes train (the local energy's variance needs it)."""
    return make_ferminet().double()
