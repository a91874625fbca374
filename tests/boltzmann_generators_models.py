"""Boltzmann generators written as Noé et al. (2019) and bgflow write them, for
``test_boltzmann_generators``.

- ``RealNVP``: affine coupling layers over a particle configuration flattened to
  ``(B, n * dim)``, alternating binary masks, an MLP conditioner giving the log-scale ``s``
  and shift ``t``; ``forward(z)`` samples (latent to configuration) and returns ``(x,
  log|det J|)``, ``forward(x, inverse=True)`` maps MD frames back to the latent for maximum
  likelihood. ``make_flow`` keeps ``s`` unbounded (``exp(s)``), ``make_flow_tanh`` bounds it
  with ``scale * tanh(s)`` as bgflow's ``AffineTransformer`` and nflows do.
- ``NeuralSplineFlow``: rational-quadratic spline couplings (Durkan et al.) sampled by the
  root of the spline's quadratic, identity tails outside ``[-3, 3]`` chosen by a where;
  ``make_spline_flow_safe`` replaces the tails' values before the spline, as nflows does.
- Energies in torch: ``LennardJones`` (bgflow's ``LennardJonesPotential``: ``4 eps ((s/r)^12
  - (s/r)^6)`` over pairs plus a harmonic oscillator keeping the cluster centred), with the
  pair distances taken three ways (``torch.cdist`` with the diagonal masked by a product, a
  hand-written ``sqrt`` over the upper triangle, ``torch.cdist`` over the upper triangle);
  ``BoltzmannGenerator`` holds the flow and the energy, as bgflow's does;
  ``Phi4Action`` (Albergo et al.'s lattice field, with ``make_phi4_flow`` over 4 x 4 sites);
  ``DoubleWell`` (the paper's ``1/4 a x1^4 - 1/2 b x1^2 + c x1 + 1/2 d x2^2``).
- Losses: ``ReverseKL`` (energy of the sample minus ``log|det J|``, energies above a cutoff
  regularised log-linearly as bgflow's ``linlogcut``, or taken raw with ``cut=False``), ``MaxLikelihood`` (the standard
  normal's log-density of the latent plus ``log|det J|``), ``ReweightedKL`` (self-normalised
  importance weights ``exp(-beta u(x) - log q(x))`` of the flow's samples at an annealed
  inverse temperature, reweighting ``-log q``; ``log_space=True`` normalises them with a
  softmax of the log-weights); ``ReweightedML`` (MD frames simulated warmer, reweighted to
  the target temperature by a softmax of their energies).
"""

from __future__ import annotations

import math

import torch
from torch import nn

N_PARTICLES, DIM = 4, 2


class Conditioner(nn.Module):
    """The coupling's MLP: the kept coordinates to ``(s, t)`` of the transformed ones."""

    def __init__(self, features: int, hidden: int = 32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.SiLU(),
                                 nn.Linear(hidden, hidden), nn.SiLU(),
                                 nn.Linear(hidden, 2 * features))

    def forward(self, x):
        s, t = self.net(x).chunk(2, dim=-1)
        return s, t


class AffineCoupling(nn.Module):
    """RealNVP's coupling: ``y = x * m + (1 - m) * (x * exp(s) + t)``, ``s, t = f(x * m)``."""

    def __init__(self, mask: torch.Tensor, bounded: bool):
        super().__init__()
        self.register_buffer("mask", mask)
        self.cond = Conditioner(mask.numel())
        self.bounded = bounded
        self.log_scale_max = nn.Parameter(torch.ones(mask.numel()))

    def scale(self, s):
        if self.bounded:  # bgflow / nflows: a bounded log-scale
            return self.log_scale_max * torch.tanh(s)
        return s

    def forward(self, x, inverse: bool = False):
        m = self.mask
        s, t = self.cond(x * m)
        s = self.scale(s) * (1 - m)
        t = t * (1 - m)
        if inverse:
            y = x * m + (1 - m) * (x - t) * torch.exp(-s)
            return y, -s.sum(-1)
        y = x * m + (1 - m) * (x * torch.exp(s) + t)
        return y, s.sum(-1)


class RealNVP(nn.Module):
    def __init__(self, features: int = N_PARTICLES * DIM, layers: int = 4,
                 bounded: bool = False):
        super().__init__()
        masks = [(torch.arange(features) + i) % 2 for i in range(layers)]
        self.layers = nn.ModuleList(AffineCoupling(m.float(), bounded) for m in masks)

    def forward(self, v, inverse: bool = False):
        logdet = torch.zeros(v.shape[0])
        for layer in (reversed(self.layers) if inverse else self.layers):
            v, ld = layer(v, inverse=inverse)
            logdet = logdet + ld
        return v, logdet


def make_flow():
    torch.manual_seed(0)
    return RealNVP()


def make_flow_tanh():
    torch.manual_seed(0)
    return RealNVP(bounded=True)


def rq_spline_inverse(y, uw, uh, ud, bound: float = 3.0, min_d: float = 1e-3,
                      safe: bool = False):
    """Durkan et al.'s rational-quadratic spline on ``[-bound, bound]``, inverted by the root
    of its quadratic (the sampling direction); identity tails outside the interval. ``safe``:
    the tails' values replaced by 0 before the spline (nflows runs it on the inside only)."""
    k_bins = uw.shape[-1]
    inside = (y > -bound) & (y < bound)
    y_tails = y
    if safe:
        y = torch.where(inside, y, torch.zeros_like(y))
    w = 2 * bound * torch.softmax(uw, -1)
    h = 2 * bound * torch.softmax(uh, -1)
    d = nn.functional.pad(nn.functional.softplus(ud) + min_d, (1, 1), value=1.0)
    cw = nn.functional.pad(torch.cumsum(w, -1), (1, 0)) - bound
    ch = nn.functional.pad(torch.cumsum(h, -1), (1, 0)) - bound
    k = torch.searchsorted(ch[..., 1:-1].contiguous(), y[..., None]).clamp(max=k_bins - 1)
    xk, yk = cw.gather(-1, k)[..., 0], ch.gather(-1, k)[..., 0]
    wk, hk = w.gather(-1, k)[..., 0], h.gather(-1, k)[..., 0]
    dk, dk1 = d.gather(-1, k)[..., 0], d.gather(-1, k + 1)[..., 0]
    s = hk / wk
    a = (y - yk) * (dk + dk1 - 2 * s) + hk * (s - dk)
    b = hk * dk - (y - yk) * (dk + dk1 - 2 * s)
    c = -s * (y - yk)
    theta = 2 * c / (-b - torch.sqrt(b ** 2 - 4 * a * c))  # the bug: run on the tails too
    t1 = theta * (1 - theta)
    den = s + (dk + dk1 - 2 * s) * t1
    dnum = s ** 2 * (dk1 * theta ** 2 + 2 * s * t1 + dk * (1 - theta) ** 2)
    logdet = 2 * torch.log(den) - torch.log(dnum)
    # identity tails by a where, where nflows computes the spline on the inside values only
    return torch.where(inside, theta * wk + xk, y_tails), torch.where(inside, logdet, 0.0)


class SplineCoupling(nn.Module):
    """A neural spline flow's coupling: the conditioner gives each transformed coordinate's
    bin widths, heights and inner derivatives."""

    def __init__(self, mask: torch.Tensor, safe: bool, bins: int = 8, hidden: int = 32):
        super().__init__()
        self.register_buffer("mask", mask.bool())
        self.safe = safe
        n_in, n_out = int(self.mask.sum()), int((~self.mask).sum())
        self.bins = bins
        self.net = nn.Sequential(nn.Linear(n_in, hidden), nn.SiLU(),
                                 nn.Linear(hidden, n_out * (3 * bins - 1)))

    def forward(self, z):
        params = self.net(z[:, self.mask]).view(z.shape[0], -1, 3 * self.bins - 1)
        uw, uh, ud = params.split([self.bins, self.bins, self.bins - 1], -1)
        y, logdet = rq_spline_inverse(z[:, ~self.mask], uw, uh, ud, safe=self.safe)
        x = z.clone()
        x[:, ~self.mask] = y
        return x, logdet.sum(-1)


class NeuralSplineFlow(nn.Module):
    def __init__(self, features: int = N_PARTICLES * DIM, layers: int = 4, safe: bool = False):
        super().__init__()
        masks = [(torch.arange(features) + i) % 2 for i in range(layers)]
        self.layers = nn.ModuleList(SplineCoupling(m, safe) for m in masks)

    def forward(self, z):
        logdet = torch.zeros(z.shape[0])
        for layer in self.layers:
            z, ld = layer(z)
            logdet = logdet + ld
        return z, logdet


def make_spline_flow():
    torch.manual_seed(0)
    return NeuralSplineFlow()


def make_spline_flow_safe():
    torch.manual_seed(0)
    return NeuralSplineFlow(safe=True)


# ---------------------------------------------------------------------------------------------
# energies


def linlogcut(u, high: float = 1e3, maximum: float = 1e9):
    """bgflow's regulariser: linear below ``high``, logarithmic above, capped at ``maximum``.
    The log branch is NaN for every energy below ``high - 1``, the where never picks it."""
    u = torch.where(u < high, u, high + torch.log(u - high + 1))
    return torch.where(u < maximum, u, torch.full_like(u, maximum))


class LennardJones(nn.Module):
    """bgflow's LennardJonesPotential over ``n`` particles in ``dim`` dimensions, with its
    harmonic oscillator; ``distances`` picks how the pair distances are taken."""

    def __init__(self, distances: str = "cdist_triu", eps: float = 1.0, sigma: float = 1.0,
                 oscillator: float = 0.5):
        super().__init__()
        self.distances, self.eps, self.sigma, self.oscillator = distances, eps, sigma, oscillator

    def pair_energy(self, r):
        return 4 * self.eps * ((self.sigma / r) ** 12 - (self.sigma / r) ** 6)

    def forward(self, x):
        pos = x.view(x.shape[0], N_PARTICLES, DIM)
        iu = torch.triu_indices(N_PARTICLES, N_PARTICLES, offset=1)
        if self.distances == "cdist_masked":
            r = torch.cdist(pos, pos)
            mask = 1 - torch.eye(N_PARTICLES)  # the bug: the diagonal's 1/0 is inf, inf * 0 NaN
            lj = 0.5 * (self.pair_energy(r) * mask).sum((-1, -2))
        elif self.distances == "sqrt_triu":
            diff = pos[:, :, None, :] - pos[:, None, :, :]
            r = (diff ** 2).sum(-1).sqrt()  # the bug: sqrt of the diagonal's 0, then picked out
            lj = self.pair_energy(r[:, iu[0], iu[1]]).sum(-1)
        else:
            r = torch.cdist(pos, pos)[:, iu[0], iu[1]]
            lj = self.pair_energy(r).sum(-1)
        centred = pos - pos.mean(1, keepdim=True)
        return lj + 0.5 * self.oscillator * (centred ** 2).sum((-1, -2))


class DoubleWell(nn.Module):
    """The Boltzmann generator paper's double well (in 2-D; the other coordinates are
    harmonic)."""

    def __init__(self, a: float = 1.0, b: float = 6.0, c: float = 1.0, d: float = 1.0):
        super().__init__()
        self.a, self.b, self.c, self.d = a, b, c, d

    def forward(self, x):
        x1, rest = x[:, 0], x[:, 1:]
        return (0.25 * self.a * x1 ** 4 - 0.5 * self.b * x1 ** 2 + self.c * x1
                + 0.5 * self.d * (rest ** 2).sum(-1))


class BoltzmannGenerator(nn.Module):
    """bgflow's ``BoltzmannGenerator``: the flow and the target energy in one module, whose
    forward samples and returns ``(x, log|det J|, u(x))``."""

    def __init__(self, distances: str):
        super().__init__()
        self.flow, self.energy = RealNVP(), LennardJones(distances)

    def forward(self, z):
        x, logdet = self.flow(z)
        return x, logdet, self.energy(x)


def make_bg_masked():
    torch.manual_seed(0)
    return BoltzmannGenerator("cdist_masked")


# ---------------------------------------------------------------------------------------------
# losses


def normal_log_prob(z):
    return -0.5 * (z ** 2).sum(-1) - 0.5 * z.shape[-1] * math.log(2 * math.pi)


class ReverseKL(nn.Module):
    """KL(q || p) up to a constant: ``E_z[u(x) - log|det J|]`` with bgflow's linlogcut."""

    def __init__(self, distances: str = "cdist_triu", cut: bool = True):
        super().__init__()
        self.energy, self.cut = LennardJones(distances), cut

    def forward(self, x, logdet):
        u = self.energy(x)
        return ((linlogcut(u) if self.cut else u) - logdet).mean()


class EnergyKL(nn.Module):
    """Reverse KL of the energies the generator computed itself."""

    def forward(self, x, logdet, u):
        return (linlogcut(u) - logdet).mean()


class DoubleWellKL(nn.Module):
    """Reverse KL against the double well: ``E_z[u(x) - log|det J|]``."""

    def __init__(self):
        super().__init__()
        self.energy = DoubleWell()

    def forward(self, x, logdet):
        return (self.energy(x) - logdet).mean()


class MaxLikelihood(nn.Module):
    """Negative log-likelihood of MD frames: ``-log N(z) - log|det J|`` of ``x -> z``."""

    def forward(self, z, logdet):
        return -(normal_log_prob(z) + logdet).mean()


class ReweightedKL(nn.Module):
    """Forward KL by self-normalised importance sampling of the flow's own samples, at the
    annealed inverse temperature ``beta`` the loop sets each step (``-sum w log q``)."""

    def __init__(self, log_space: bool = False):
        super().__init__()
        self.energy = DoubleWell()
        self.beta, self.log_space = 1.0, log_space

    def forward(self, x, logdet, z):
        logq = normal_log_prob(z) - logdet
        logw = (-self.beta * self.energy(x) - logq).detach()
        if self.log_space:
            w = torch.softmax(logw, 0)
        else:
            w = torch.exp(logw)  # the bug: exp of a log-weight past 88 overflows
            w = w / w.sum()
        return -(w * logq).sum()


class Phi4Action(nn.Module):
    """Albergo et al.'s lattice phi^4 action on an ``L x L`` periodic lattice, as the reverse
    KL ``E_z[S(phi) - log|det J|]`` of flow-based sampling for lattice field theory."""

    def __init__(self, size: int = 4, kappa: float = 0.3, lam: float = 0.02):
        super().__init__()
        self.size, self.kappa, self.lam = size, kappa, lam

    def forward(self, phi, logdet):
        phi = phi.view(-1, self.size, self.size)
        hop = sum(phi * torch.roll(phi, 1, d) for d in (1, 2))
        action = (-2 * self.kappa * hop + (1 - 2 * self.lam) * phi ** 2
                  + self.lam * phi ** 4).sum((1, 2))
        return (action - logdet).mean()


def make_phi4_flow():
    torch.manual_seed(0)
    return RealNVP(features=16)


class ReweightedML(nn.Module):
    """Maximum likelihood of MD frames simulated at ``beta_md``, reweighted to the target's
    ``beta`` by ``softmax(-(beta - beta_md) u(x))`` (normalised in log space)."""

    def __init__(self, beta_md: float = 0.8, beta: float = 1.0):
        super().__init__()
        self.energy = LennardJones()
        self.beta_md, self.beta = beta_md, beta

    def forward(self, z, logdet, x):
        logw = -(self.beta - self.beta_md) * self.energy(x)
        w = torch.softmax(logw, 0)
        return -(w * (normal_log_prob(z) + logdet)).sum()


# ---------------------------------------------------------------------------------------------
# data


def latent_batch(g: torch.Generator, size: int = 16):
    return torch.randn(size, N_PARTICLES * DIM, generator=g)


def md_frames(g: torch.Generator, bad: int | None, size: int = 16, duplicate: bool = False):
    """Frames of an LJ cluster around a square lattice (nm); frame ``bad`` was written in
    the trajectory's raw unwrapped coordinates (a particle thousands of box lengths away),
    or (``duplicate``) with particle 0's record written again as particle 1."""
    lattice = torch.tensor([[0.0, 0.0], [1.1, 0.0], [0.0, 1.1], [1.1, 1.1]]) - 0.55
    x = lattice.flatten() + 0.05 * torch.randn(size, N_PARTICLES * DIM, generator=g)
    if bad is not None and duplicate:
        x[bad, 2:4] = x[bad, 0:2]
    elif bad is not None:
        x[bad, 3] = 4.0e3
    return x
