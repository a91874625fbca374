"""High-energy-physics jet models, as ParticleNet / Particle Transformer / CaloFlow write them,
for ``test_particle_physics``.

- jets: each a variable number of massless particles ``(px, py, pz, E)`` around a jet axis,
  padded to ``P`` by ``collate_jets`` (a DataLoader's ``collate_fn``) with a particle mask;
  per jet a label (QCD or top: imbalanced), a generator weight (MC@NLO: +-1, some negative) and
  the jet energy (the regression target).
- ``particle_features``: per particle ``log(pT)``, ``log(E)``, ``deta``, ``dphi`` to the jet
  axis (the pT-weighted mean), computed inside the model from the four-momenta and masked.
- ``ParticleNet``: EdgeConv blocks; the kNN graph from ``topk`` over pairwise distances in
  (eta, phi), padded particles shifted far away (``coord_shift``) so no one picks them.
- ``ParticleTransformer``: particle attention biased by pairwise interaction features
  ``ln kT``, ``ln z``, ``ln dR``, ``ln m^2`` from the pairs' four-momenta.
- ``JetRegressor``: the corrected jet four-momentum; its loss takes the signed mass
  (``sqrt(m2)`` or ``-sqrt(-m2)``, a space-like vector's mass) of the prediction.
- ``ShowerFlow``: a RealNVP flow over a calorimeter shower's voxel energies, preprocessed with
  CaloFlow's logit transform of each voxel's share of the shower energy.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

P, FEATS = 12, 4  # particles per padded jet, input features per particle


# ---------------------------------------------------------------------------------------------
# data


def make_jets(g: torch.Generator, n: int, first: int = 0, bad: dict | None = None) -> list:
    """``n`` jets as (four-momenta (n_i, 4), label, weight, energy); ``bad``: data conditions of
    one jet (``collinear``: a massless particle repeated, ``huge``: an energy of ``huge`` GeV,
    ``nan``: a particle's pz NaN, ``weights``: the generator weights of the batch, ``empty``:
    no particle passed the cuts)."""
    bad = bad or {}
    jets = []
    for i in range(first, first + n):
        k = int(torch.randint(4, P + 1, (1,), generator=g))
        if bad.get("empty") == i:  # every particle failed the selection cuts
            k = 0
        pt = 5 + 40 * torch.rand(k, generator=g)
        eta = 0.3 * torch.randn(k, generator=g) + 0.5 * torch.randn(1, generator=g)
        phi = 0.3 * torch.randn(k, generator=g) + 2 * torch.rand(1, generator=g)
        p4 = torch.stack([pt * phi.cos(), pt * phi.sin(), pt * eta.sinh(), pt * eta.cosh()], -1)
        label = int(torch.rand(1, generator=g) < 0.25)  # a quarter are top jets
        weight = 1.0 if torch.rand(1, generator=g) < 0.8 else -1.0
        if bad.get("collinear") == i:  # a photon pair in one calorimeter cell, exactly
            p4[1] = p4[0]
        if bad.get("nan") == i:  # a track with no pz from the reconstruction
            p4[2, 2] = float("nan")
        energy = float(p4[:, 3].sum())
        if bad.get("huge") == i:  # a mis-calibrated jet
            energy = bad["energy"]
        if "weights" in bad:
            weight = float(bad["weights"][i - first])
        jets.append((p4, label, weight, energy))
    return jets


def collate_jets(jets: list):
    """Pad to ``P`` particles: (four-momenta (B, 4, P), mask (B, 1, P), labels, weights,
    energies)."""
    v = torch.zeros(len(jets), 4, P)
    mask = torch.zeros(len(jets), 1, P)
    for b, (p4, _, _, _) in enumerate(jets):
        v[b, :, :len(p4)] = p4.T
        mask[b, 0, :len(p4)] = 1
    labels = torch.tensor([j[1] for j in jets])
    weights = torch.tensor([j[2] for j in jets])
    energy = torch.tensor([j[3] for j in jets])
    return v, mask, labels, weights, energy


def pt_eta_phi(v):
    px, py, pz, e = v.unbind(1)
    pt = torch.hypot(px, py)
    return pt, torch.asinh(pz / pt.clamp_min(1e-8)), torch.atan2(py, px), e


def particle_features(v, mask, eps: float = 1e-8):
    """log(pT), log(E), deta, dphi per particle (B, 4, P); ``eps=0``: the log of a padded
    particle's 0, then masked."""
    pt, eta, phi, e = pt_eta_phi(v)
    w = pt * mask[:, 0]
    axis_eta = (w * eta).sum(-1, keepdim=True) / w.sum(-1, keepdim=True)
    axis_phi = (w * phi).sum(-1, keepdim=True) / w.sum(-1, keepdim=True)
    dphi = torch.remainder(phi - axis_phi + math.pi, 2 * math.pi) - math.pi
    if eps:
        logs = [torch.log(pt.clamp_min(eps)), torch.log(e.clamp_min(eps))]
    else:
        logs = [torch.log(pt), torch.log(e)]
    return torch.stack([*logs, eta - axis_eta, dphi], 1) * mask


# ---------------------------------------------------------------------------------------------
# ParticleNet


def knn(points, k: int):
    """Indices of each particle's ``k`` nearest neighbours (itself left out) by the squared
    distances ``|x_i|^2 - 2 x_i.x_j + |x_j|^2``, as DGCNN computes them."""
    inner = -2 * torch.matmul(points.transpose(2, 1), points)
    xx = points.pow(2).sum(1, keepdim=True)
    return (-xx - inner - xx.transpose(2, 1)).topk(k + 1, dim=-1)[1][:, :, 1:]


class EdgeConv(nn.Module):
    def __init__(self, k: int, cin: int, cout: int):
        super().__init__()
        self.k = k
        self.mlp = nn.Sequential(nn.Conv2d(2 * cin, cout, 1, bias=False), nn.BatchNorm2d(cout),
                                 nn.ReLU())
        self.shortcut = nn.Conv1d(cin, cout, 1)

    def forward(self, points, x, mask):
        idx = knn(points, self.k)  # (B, P, k)
        b, c, p = x.shape
        nbr = x.transpose(1, 2)[torch.arange(b)[:, None, None], idx].permute(0, 3, 1, 2)
        ctr = x[..., None].expand(-1, -1, -1, self.k)
        edge = self.mlp(torch.cat([ctr, nbr - ctr], 1)).mean(-1)
        return F.relu(edge + self.shortcut(x)) * mask


class ParticleNet(nn.Module):
    def __init__(self, k: int = 3, dims=(16, 16), eps: float = 1e-8, shift: float = 1e9):
        super().__init__()
        self.eps, self.shift = eps, shift
        self.bn = nn.BatchNorm1d(FEATS)
        self.blocks = nn.ModuleList()
        cin = FEATS
        for d in dims:
            self.blocks.append(EdgeConv(k, cin, d))
            cin = d
        self.head = nn.Sequential(nn.Linear(cin, 16), nn.ReLU(), nn.Linear(16, 2))

    def forward(self, v, mask):
        x = self.bn(particle_features(v, mask, self.eps)) * mask
        coord_shift = (mask == 0) * self.shift  # padded particles far from every real one
        points = x[:, 2:4]
        for block in self.blocks:
            x = block(points + coord_shift, x, mask)
            points = x
        pooled = x.sum(-1) / mask.sum(-1)
        return self.head(pooled)


def make_particlenet() -> ParticleNet:
    torch.manual_seed(0)
    return ParticleNet()


def make_particlenet_unsafe_log() -> ParticleNet:
    torch.manual_seed(0)
    return ParticleNet(eps=0.0)


class WeightedCE(nn.Module):
    """Cross-entropy weighted by the generator weights, normalised by their sum (``norm="sum"``)
    or by the batch size; ``class_weights`` balance QCD and top."""

    def __init__(self, norm: str = "count", class_weights=(1.0, 3.0)):
        super().__init__()
        self.norm = norm
        self.register_buffer("class_weights", torch.tensor(class_weights))

    def forward(self, logits, labels, weights):
        ce = F.cross_entropy(logits, labels, weight=self.class_weights, reduction="none")
        if self.norm == "sum":
            return (weights * ce).sum() / weights.sum()
        return (weights * ce).mean()


# ---------------------------------------------------------------------------------------------
# Particle Transformer


def pairwise_features(v, eps: float = 1e-8, clamp_m2: bool = True):
    """ParT's interaction features of every pair (B, 4, P, P): ln kT, ln z, ln dR, ln m^2 (of
    the pair's summed four-momentum; ``clamp_m2=False``: its rounding below 0 unguarded)."""
    pt, eta, phi, e = pt_eta_phi(v)
    pti, ptj = pt[:, :, None], pt[:, None, :]
    deta = eta[:, :, None] - eta[:, None, :]
    dphi = torch.remainder(phi[:, :, None] - phi[:, None, :] + math.pi, 2 * math.pi) - math.pi
    delta = torch.sqrt(deta ** 2 + dphi ** 2)
    ptmin = torch.minimum(pti, ptj)
    lnkt = torch.log((ptmin * delta).clamp(min=eps))
    lnz = torch.log((ptmin / (pti + ptj).clamp(min=eps)).clamp(min=eps))
    lndelta = torch.log(delta.clamp(min=eps))
    s = v[:, :, :, None] + v[:, :, None, :]  # (B, 4, P, P)
    m2 = s[:, 3] ** 2 - s[:, 0] ** 2 - s[:, 1] ** 2 - s[:, 2] ** 2
    lnm2 = torch.log(m2.clamp(min=eps) if clamp_m2 else m2)
    return torch.stack([lnkt, lnz, lndelta, lnm2], 1)


class ParticleTransformer(nn.Module):
    def __init__(self, dim: int = 16, heads: int = 2, clamp_m2: bool = True):
        super().__init__()
        self.heads, self.clamp_m2 = heads, clamp_m2
        self.embed = nn.Sequential(nn.Linear(FEATS, dim), nn.GELU())
        self.pair_embed = nn.Conv2d(4, heads, 1)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 2)

    def forward(self, v, mask):
        x = self.embed(particle_features(v, mask).transpose(1, 2))  # (B, P, dim)
        with torch.no_grad():
            u = pairwise_features(v, clamp_m2=self.clamp_m2)
        bias = self.pair_embed(u)  # (B, heads, P, P)
        pad = mask[:, 0] == 0  # (B, P)
        bias = bias.masked_fill(pad[:, None, None, :], float("-inf"))
        bias = bias.flatten(0, 1)  # (B * heads, P, P)
        h, _ = self.attn(x, x, x, attn_mask=bias, need_weights=False)
        x = self.norm(x + h) * mask.transpose(1, 2)
        return self.head(x.sum(1) / mask.sum(-1))


def make_part() -> ParticleTransformer:
    torch.manual_seed(0)
    return ParticleTransformer()


def make_part_unclamped() -> ParticleTransformer:
    torch.manual_seed(0)
    return ParticleTransformer(clamp_m2=False)


# ---------------------------------------------------------------------------------------------
# jet energy / four-momentum regression


class JetRegressor(nn.Module):
    """Deep-Sets regression of the jet's corrected four-momentum (B, 4) from its particles."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.phi = nn.Sequential(nn.Linear(FEATS, dim), nn.ReLU(), nn.Linear(dim, dim))
        self.rho = nn.Sequential(nn.ReLU(), nn.Linear(dim, 4))

    def forward(self, v, mask):
        x = self.phi(particle_features(v, mask).transpose(1, 2)) * mask.transpose(1, 2)
        raw = v.sum(-1)  # the uncorrected jet four-momentum
        return raw * (1 + 0.1 * self.rho(x.sum(1)))


def make_regressor() -> JetRegressor:
    torch.manual_seed(0)
    return JetRegressor()


def log_cosh(pred, target):
    """log(cosh(pred - target)) as written from its definition: cosh overflows past |x| ~ 89."""
    return torch.log(torch.cosh(pred - target)).mean()


def log_cosh_stable(pred, target):
    x = pred - target
    return (x + F.softplus(-2 * x) - math.log(2)).mean()


def signed_mass(p4):
    """A four-vector's mass, negative for a space-like one (as ROOT's TLorentzVector::M)."""
    m2 = p4[:, 3] ** 2 - (p4[:, :3] ** 2).sum(-1)
    return torch.where(m2 >= 0, torch.sqrt(m2), -torch.sqrt(-m2))


class EnergyMassLoss(nn.Module):
    """The jet energy's relative error (a log-cosh of it) plus the mass's squared error, in
    units of the jet energy."""

    def __init__(self, mass_weight: float = 0.1):
        super().__init__()
        self.mass_weight = mass_weight

    def forward(self, pred, energy, true_p4):
        rel = (pred[:, 3] - energy) / energy
        mass_err = (signed_mass(pred) - signed_mass(true_p4)) / energy
        return log_cosh_stable(rel, 0 * rel) + self.mass_weight * (mass_err ** 2).mean()


# ---------------------------------------------------------------------------------------------
# calorimeter shower flow


VOXELS = 8


def shower_batch(g: torch.Generator, n: int = 8, empty_voxel: int | None = None):
    """Showers: ``VOXELS`` voxel energies (GeV) from an exponential profile, and the incident
    energy; ``empty_voxel``: every shower has no deposit there (a dead cell)."""
    depth = torch.arange(VOXELS, dtype=torch.float32)
    e_inc = 10 + 90 * torch.rand(n, 1, generator=g)
    profile = torch.exp(-depth / 3) * (0.5 + torch.rand(n, VOXELS, generator=g))
    shower = e_inc * profile / profile.sum(-1, keepdim=True) * 0.9
    if empty_voxel is not None:
        shower[:, empty_voxel] = 0.0
    return shower, e_inc


def logit_preprocess(shower, e_inc, alpha: float = 1e-6):
    """CaloFlow's preprocessing: each voxel's share of the incident energy squeezed into
    ``(alpha, 1 - alpha)`` and sent through the logit."""
    u = alpha + (1 - 2 * alpha) * shower / e_inc
    return torch.log(u / (1 - u))


class Coupling(nn.Module):
    def __init__(self, flip: bool, dim: int = 16, bound_scale: bool = True):
        super().__init__()
        self.flip, self.bound_scale = flip, bound_scale
        self.net = nn.Sequential(nn.Linear(VOXELS // 2 + 1, dim), nn.ReLU(),
                                 nn.Linear(dim, VOXELS))

    def forward(self, x, cond):
        a, b = x.chunk(2, -1)
        if self.flip:
            a, b = b, a
        s, t = self.net(torch.cat([a, cond], -1)).chunk(2, -1)
        if self.bound_scale:
            s = torch.tanh(s)
        b = b * torch.exp(s) + t
        out = torch.cat([b, a] if self.flip else [a, b], -1)
        return out, s.sum(-1)


class ShowerFlow(nn.Module):
    """RealNVP over the preprocessed voxels, conditioned on log of the incident energy; returns
    the latent and the log-determinant."""

    def __init__(self, layers: int = 4, bound_scale: bool = True):
        super().__init__()
        self.layers = nn.ModuleList([Coupling(i % 2 == 1, bound_scale=bound_scale)
                                     for i in range(layers)])

    def forward(self, x, e_inc):
        cond = torch.log(e_inc / 10)
        logdet = torch.zeros(len(x))
        for layer in self.layers:
            x, ld = layer(x, cond)
            logdet = logdet + ld
        return x, logdet


def make_flow() -> ShowerFlow:
    torch.manual_seed(0)
    return ShowerFlow()


def make_flow_unbounded() -> ShowerFlow:
    """The coupling scales ``exp(s)`` without CaloFlow's ``tanh`` bound on ``s``."""
    torch.manual_seed(0)
    return ShowerFlow(bound_scale=False)


def flow_nll(out):
    """The negative log-likelihood under a standard normal base, from its density."""
    z, logdet = out
    density = torch.exp(-0.5 * z ** 2) / math.sqrt(2 * math.pi)
    return -(torch.log(density).sum(-1) + logdet).mean()


def flow_nll_stable(out):
    z, logdet = out
    return (0.5 * z ** 2 + 0.5 * math.log(2 * math.pi)).sum(-1).mean() - logdet.mean()
