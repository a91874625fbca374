"""Neural fields written by hand, as SIREN's explore_siren, IGR/NeuS, Instant-NGP's torch
ports and Tancik et al.'s Fourier features write them, for ``test_neural_fields``.

- ``HashSDF``: a signed distance field on a multiresolution hash grid (Instant-NGP's spatial
  hash of integer corners, trilinear interpolation) and a small MLP; ``forward`` takes the
  field's gradient with ``autograd.grad(create_graph=True)`` (IGR's ``gradient()``) and
  returns ``(sdf, grad)``. Coordinates are clamped to the grid's box, as the torch ports do,
  so a point outside it has a gradient of exactly 0. The loss (``sdf_loss``) is IGR's:
  the SDF on the surface, normals ``grad / |grad|`` against the ground truth's by cosine,
  and the eikonal ``(|grad| - 1)^2`` with ``|grad|`` written as ``sqrt(sum(g^2))``.
- ``Siren``: sine layers with omega_0 = 30 and SIREN's init; ``make_siren_poisson`` fits an
  image from its gradients (Poisson reconstruction: the field's gradient by
  ``autograd.grad(create_graph=True)`` against the image's Sobel gradients).
- ``FourierField``: Gaussian Fourier features ``sin/cos(2 pi B x)`` (scale 10) and a ReLU
  MLP; under fp16 autocast the projection of coordinates given in pixels overflows.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

PRIMES = (1, 2654435761, 805459861)
CORNERS = torch.tensor([[i, j, k] for i in (0, 1) for j in (0, 1) for k in (0, 1)])


class HashGrid(nn.Module):
    """Instant-NGP's multiresolution hash encoding, written in torch."""

    def __init__(self, levels: int = 4, table: int = 2 ** 10, feats: int = 2,
                 base: int = 4, growth: float = 1.6):
        super().__init__()
        self.res = [int(base * growth ** i) for i in range(levels)]
        self.table = table
        self.embeddings = nn.Parameter(torch.empty(levels, table, feats).uniform_(-1e-2, 1e-2))

    def hash(self, idx):
        h = idx[..., 0] * PRIMES[0] ^ idx[..., 1] * PRIMES[1] ^ idx[..., 2] * PRIMES[2]
        return h % self.table

    def forward(self, x):
        x = x.clamp(0.0, 1.0)  # points outside the box read its faces
        out = []
        for lvl, res in enumerate(self.res):
            pos = x * res
            lo = pos.floor().long()
            frac = pos - lo
            idx = lo[:, None, :] + CORNERS[None]  # (N, 8, 3)
            w = torch.where(CORNERS[None].bool(), frac[:, None, :], 1 - frac[:, None, :])
            feats = self.embeddings[lvl][self.hash(idx)]  # (N, 8, F)
            out.append((w.prod(-1, keepdim=True) * feats).sum(1))
        return torch.cat(out, -1)


class HashSDF(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoding = HashGrid()
        self.net = nn.Sequential(nn.Linear(8 + 3, 64), nn.Softplus(beta=100),
                                 nn.Linear(64, 64), nn.Softplus(beta=100), nn.Linear(64, 1))

    def sdf(self, x):
        return self.net(torch.cat([self.encoding(x), x.clamp(0.0, 1.0)], -1))

    def forward(self, x):
        with torch.enable_grad():
            x = x.requires_grad_(True)
            y = self.sdf(x)
            grad = torch.autograd.grad(y, x, torch.ones_like(y), create_graph=True)[0]
        return y, grad


def make_hash_sdf() -> HashSDF:
    torch.manual_seed(0)
    return HashSDF()


def sdf_loss(sdf, grad, gt_sdf, gt_normals, on_surface):
    """IGR's loss: |sdf| on the surface, 1 - cos(normal, gt) there, eikonal everywhere."""
    grad_norm = grad.pow(2).sum(-1).sqrt()
    normals = grad / grad_norm[:, None]  # the bug: no eps, 0/0 where the field is flat
    cos = (normals * gt_normals).sum(-1)
    surf = on_surface.float()
    normal_term = ((1 - cos) * surf).sum() / surf.sum()
    sdf_term = (sdf.squeeze(-1).abs() * surf).sum() / surf.sum()
    eikonal = ((grad_norm - 1) ** 2).mean()
    return 3e3 * sdf_term + 1e2 * normal_term + 5e1 * eikonal


def eikonal_loss(sdf, grad, gt_sdf, gt_normals, on_surface):
    """The same loss with the normals by ``F.normalize`` (its eps): only the eikonal's
    hand-written sqrt is left at 0 where the field is flat."""
    gnorm = grad.pow(2).sum(-1).sqrt()
    cos = (F.normalize(grad, dim=-1) * gt_normals).sum(-1)
    surf = on_surface.float()
    normal_term = ((1 - cos) * surf).sum() / surf.sum()
    sdf_term = (sdf.squeeze(-1).abs() * surf).sum() / surf.sum()
    eikonal = ((gnorm - 1) ** 2).mean()
    return 3e3 * sdf_term + 1e2 * normal_term + 5e1 * eikonal


def safe_sdf_loss(sdf, grad, gt_sdf, gt_normals, on_surface):
    """The fixed loss: ``linalg.vector_norm`` (its backward is 0 at 0) and F.normalize."""
    grad_norm = torch.linalg.vector_norm(grad, dim=-1)
    cos = F.cosine_similarity(grad, gt_normals, dim=-1)
    surf = on_surface.float()
    normal_term = ((1 - cos) * surf).sum() / surf.sum()
    sdf_term = (sdf.squeeze(-1).abs() * surf).sum() / surf.sum()
    eikonal = ((grad_norm - 1) ** 2).mean()
    return 3e3 * sdf_term + 1e2 * normal_term + 5e1 * eikonal


def sphere_batch(g: torch.Generator, bad: int | None, n: int = 32, box: bool = True):
    """Half the points on a sphere of radius 0.3 around (0.5, 0.5, 0.5) with its normals, half
    uniform in the unit box; ``bad``: that point sampled in a box padded by 0.5 (a sampler
    whose bounds are the scene's, not the grid's)."""
    half = n // 2
    d = F.normalize(torch.randn(half, 3, generator=g), dim=-1)
    surf = 0.5 + 0.3 * d
    free = torch.rand(n - half, 3, generator=g)
    x = torch.cat([surf, free])
    normals = torch.cat([d, torch.zeros(n - half, 3)])
    on = torch.arange(n) < half
    if bad is not None:
        x[bad] = torch.tensor([1.4, 1.3, -0.4])
    gt = (x - 0.5).norm(dim=-1) - 0.3
    return x, gt, normals, on


# ---------------------------------------------------------------------------------------------
# SIREN


class SineLayer(nn.Module):
    """SIREN's layer: sin(omega_0 (W x + b)), W uniform in +-1/in (first) or
    +-sqrt(6/in)/omega_0."""

    def __init__(self, fan_in, fan_out, first: bool = False, omega_0: float = 30.0):
        super().__init__()
        self.omega_0 = omega_0
        self.linear = nn.Linear(fan_in, fan_out)
        bound = 1 / fan_in if first else math.sqrt(6 / fan_in) / omega_0
        with torch.no_grad():
            self.linear.weight.uniform_(-bound, bound)

    def forward(self, x):
        return torch.sin(self.omega_0 * self.linear(x))


class Siren(nn.Module):
    def __init__(self, hidden: int = 64, layers: int = 3, omega_0: float = 30.0):
        super().__init__()
        mods = [SineLayer(2, hidden, first=True, omega_0=omega_0)]
        mods += [SineLayer(hidden, hidden, omega_0=omega_0) for _ in range(layers - 1)]
        self.net = nn.Sequential(*mods)
        self.last = nn.Linear(hidden, 1)
        bound = math.sqrt(6 / hidden) / omega_0
        with torch.no_grad():
            self.last.weight.uniform_(-bound, bound)

    def forward(self, coords):
        with torch.enable_grad():
            coords = coords.clone().detach().requires_grad_(True)
            out = self.last(self.net(coords))
            grad = torch.autograd.grad(out, coords, torch.ones_like(out), create_graph=True)[0]
        return out, grad


def make_siren_poisson() -> Siren:
    torch.manual_seed(0)
    return Siren()


def poisson_loss(out, grad, gt_grad):
    """explore_siren's gradients loss: MSE of the field's gradient against the image's."""
    return ((grad - gt_grad) ** 2).sum(-1).mean()


def image_grad_batch(g: torch.Generator, bad: int | None, n: int = 64):
    """Random pixel coordinates in [-1, 1]^2 of a smooth image and its gradient there."""
    x = torch.rand(n, 2, generator=g) * 2 - 1
    img_grad = torch.stack([torch.cos(3 * x[:, 0]), -torch.sin(2 * x[:, 1])], -1)
    return x, img_grad


# ---------------------------------------------------------------------------------------------
# Fourier features


class FourierFeatures(nn.Module):
    def __init__(self, d_in: int = 2, n: int = 64, scale: float = 10.0):
        super().__init__()
        self.register_buffer("B", torch.randn(d_in, n) * scale)

    def forward(self, x):
        proj = 2 * math.pi * x @ self.B
        return torch.cat([torch.sin(proj), torch.cos(proj)], -1)


class FourierField(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoding = FourierFeatures()
        self.mlp = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                                 nn.Linear(64, 3), nn.Sigmoid())

    def forward(self, x):
        return self.mlp(self.encoding(x))


def make_fourier() -> FourierField:
    torch.manual_seed(0)
    return FourierField()


def pixel_batch(g: torch.Generator, bad: int | None, n: int = 64, side: int = 256):
    """Pixel coordinates normalised to [0, 1] and their RGB; ``bad``: that record's
    coordinates left in pixels (a tile loader that forgot to divide by the side)."""
    ij = torch.randint(0, side, (n, 2), generator=g).float()
    rgb = torch.stack([torch.sin(ij[:, 0] / 40), torch.cos(ij[:, 1] / 30),
                       torch.sin((ij[:, 0] + ij[:, 1]) / 50)], -1) * 0.5 + 0.5
    x = ij / side
    if bad is not None:
        x[bad] = ij[bad] * 40  # (and at 4x supersampling: about 1e4 in fp16)
    return x, rgb


# ---------------------------------------------------------------------------------------------
# Occupancy networks


class OccupancyNet(nn.Module):
    """Occupancy Networks' decoder without the encoder: Fourier features of the point (scale
    1), a ReLU MLP, one logit per point. IGR-style near-surface points are drawn in
    ``forward`` from the model's own generator (a seeded sampler the repo keeps per run)."""

    def __init__(self, sigma: float = 0.05):
        super().__init__()
        self.encoding = FourierFeatures(d_in=3, n=32, scale=1.0)
        self.mlp = nn.Sequential(nn.Linear(64 + 3, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                                 nn.Linear(64, 1))
        self.sigma = sigma
        self.gen = torch.Generator().manual_seed(7)

    def forward(self, x):
        near = x + self.sigma * torch.randn(x.shape, generator=self.gen)
        pts = torch.cat([x, near])
        return self.mlp(torch.cat([self.encoding(pts), pts], -1)).squeeze(-1)


def make_occupancy() -> OccupancyNet:
    torch.manual_seed(0)
    return OccupancyNet()


def occupancy_bce(logits, occ):
    """BCE written out (as the repos that predate BCEWithLogits do): probabilities, then
    logs of p and 1 - p; the near points take their centre's label."""
    p = torch.sigmoid(logits)
    y = torch.cat([occ, occ])
    return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()


def occupancy_batch(g: torch.Generator, bad: int | None, n: int = 32):
    """Points in a box around a sphere of radius 0.5, labelled inside/outside; ``bad``: that
    point left in the scanner's units (0.1 mm: x 1e4) by a converter that missed one mesh."""
    x = torch.rand(n, 3, generator=g) * 2 - 1
    occ = (x.norm(dim=-1) < 0.5).float()
    if bad is not None:
        x[bad] = x[bad] * 1e4
    return x, occ


def make_hash_sdf_zero_head() -> HashSDF:
    """The SDF's last layer zero-initialised with a bias of -0.3 (a field starting as a
    constant, as some ports start a residual head): its gradient is 0 at every point."""
    model = make_hash_sdf()
    with torch.no_grad():
        model.net[-1].weight.zero_()
        model.net[-1].bias.fill_(-0.3)
    return model


def cosine_sdf_loss(sdf, grad, gt_sdf, gt_normals, on_surface):
    """IGR's loss with the cosine written out and masked to the surface points by a product
    (the off-surface points carry zero normals: their cosine is 0/0, which ``* surf`` keeps)."""
    cos = (grad * gt_normals).sum(-1) / (grad.norm(dim=-1) * gt_normals.norm(dim=-1))
    surf = on_surface.float()
    normal_term = (surf * (1 - cos)).sum() / surf.sum()
    sdf_term = (sdf.squeeze(-1).abs() * surf).sum() / surf.sum()
    eikonal = ((torch.linalg.vector_norm(grad, dim=-1) - 1) ** 2).mean()
    return 3e3 * sdf_term + 1e2 * normal_term + 5e1 * eikonal
