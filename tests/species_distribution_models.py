"""Species distribution models as ecologists write them in torch, for
``test_species_distribution``.

- ``PoissonSDM``: presence-only data as an inhomogeneous Poisson point process (MaxEnt's
  equivalent, Renner et al. 2015): covariates standardised with the training set's mean and
  std (buffers), a linear term plus a small MLP for the log-intensity ``eta``, and the
  background-point quadrature ``-sum eta(presences) + sum w * exp(eta(background))``.
  ``ppp_loss_naive`` takes ``log(exp(eta))`` (the bug: exp underflows to 0 for a presence at
  an extreme covariate); ``dwpr_loss``: down-weighted Poisson regression with the pseudo
  response ``z = y / w`` (the bug: a quadrature weight of 0 for a presence's cell).
- ``Occupancy``: a single-season occupancy model (MacKenzie et al. 2002) with imperfect
  detection: ``psi = sigmoid(site covariates)``, ``p = sigmoid(visit covariates)`` per visit,
  the latent occupied state marginalised. ``occupancy_nll_product`` multiplies the detection
  probabilities over the visits before the log (the bug: underflow over many occasions);
  ``occupancy_nll_log1m`` writes ``log(1 - psi)`` (the bug: psi saturates to 1 in float32);
  ``occupancy_nll`` is the stable form (logsigmoid, logsumexp with a ``-inf`` branch for
  sites with detections), the healthy version.
- ``MultiSpeciesGrid``: a hierarchical joint SDM: per-species coefficients drawn around a
  community mean (their prior's scale ``exp(log_sigma)`` a parameter) and a spatial random
  effect per grid cell, fitted with LBFGS on the whole survey.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# ---------------------------------------------------------------------------------------------
# presence-only: the inhomogeneous Poisson point process


class Standardise(nn.Module):
    """Covariates centred and scaled with the training set's statistics (kept as buffers)."""

    def __init__(self, mean: torch.Tensor, std: torch.Tensor):
        super().__init__()
        self.register_buffer("mean", mean)
        self.register_buffer("std", std)

    def forward(self, x):
        return (x - self.mean) / self.std  # the bug (with a constant covariate): no eps


class PoissonSDM(nn.Module):
    """log-intensity = linear response + a small MLP (a GAM-like smooth), per point."""

    def __init__(self, mean: torch.Tensor, std: torch.Tensor, hidden: int = 16):
        super().__init__()
        d = mean.numel()
        self.scale = Standardise(mean, std)
        self.linear = nn.Linear(d, 1)
        self.smooth = nn.Sequential(nn.Linear(d, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, x):
        z = self.scale(x)
        return (self.linear(z) + self.smooth(z)).squeeze(-1)


N_COV = 5


def landscape(g: torch.Generator, n: int = 512, constant: int | None = None) -> torch.Tensor:
    """Environmental covariates of ``n`` cells (elevation km, temperature, rainfall, two
    land-cover fractions); ``constant``: a land-cover column absent from the whole study
    region (all 0, a std of 0)."""
    x = torch.randn(n, N_COV, generator=g) * torch.tensor([0.5, 3.0, 200.0, 0.2, 0.2])
    x = x + torch.tensor([1.0, 15.0, 800.0, 0.3, 0.3])
    if constant is not None:
        x[:, constant] = 0.0
    return x


def make_ppp() -> PoissonSDM:
    torch.manual_seed(0)
    x = landscape(torch.Generator().manual_seed(42))
    return PoissonSDM(x.mean(0), x.std(0))


def make_ppp_constant_cover() -> PoissonSDM:
    torch.manual_seed(0)
    x = landscape(torch.Generator().manual_seed(42), constant=4)
    return PoissonSDM(x.mean(0), x.std(0))


def presence_background(g: torch.Generator, n_pres: int = 24, n_bg: int = 40,
                        area: float = 100.0, bad: int | None = None, nodata: bool = False,
                        constant: int | None = None):
    """One batch of points: presences first, then background points, their quadrature
    weights (area / number of background points; presences 1e-6, as DWPR sets them) and
    the presence indicator. ``bad`` with ``nodata``: that presence's temperature is the
    raster's NoData value -9999 (a coastal record the climate layer does not cover);
    without: that presence's cell has a weight of 0 (a cell the land mask cut to no area).
    ``constant``: as :func:`landscape`'s."""
    x = landscape(g, n_pres + n_bg, constant)
    y = torch.cat([torch.ones(n_pres), torch.zeros(n_bg)])
    w = torch.cat([torch.full((n_pres,), 1e-6), torch.full((n_bg,), area / n_bg)])
    if bad is not None and nodata:
        x[bad, 1] = -9999.0
    elif bad is not None:
        w[bad] = 0.0
    return x, y, w


def ppp_loss_naive(eta, y, w):
    """The point process's negative log-likelihood, intensity first, then its log."""
    lam = torch.exp(eta)
    pres = y > 0
    return -torch.log(lam[pres]).sum() + (w[~pres] * lam[~pres]).sum()  # the bug: log(exp)


def ppp_loss(eta, y, w):
    """The same likelihood with the log-intensity used as is (the fix)."""
    pres = y > 0
    return -eta[pres].sum() + (w[~pres] * eta[~pres].exp()).sum()


def dwpr_loss(eta, y, w):
    """Down-weighted Poisson regression: a weighted Poisson GLM of the pseudo response
    ``z = y / w`` (Berman & Turner's quadrature), as ``glm(z ~ ., weights = w)`` fits it."""
    z = y / w  # the bug: a presence whose weight is 0
    return -(w * (z * eta - eta.exp())).sum()


# ---------------------------------------------------------------------------------------------
# occupancy with imperfect detection


class Occupancy(nn.Module):
    """psi from site covariates, p from visit covariates (per site and visit); returns the
    logits of both, as the likelihood wants them."""

    def __init__(self, site_dim: int = 3, visit_dim: int = 2, hidden: int = 16):
        super().__init__()
        self.occ = nn.Sequential(nn.Linear(site_dim, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        self.det = nn.Linear(visit_dim + site_dim, 1)

    def forward(self, site_x, visit_x):
        j = visit_x.shape[1]
        occ_logit = self.occ(site_x).squeeze(-1)
        both = torch.cat([visit_x, site_x[:, None].expand(-1, j, -1)], -1)
        return occ_logit, self.det(both).squeeze(-1)


def make_occupancy() -> Occupancy:
    torch.manual_seed(0)
    return Occupancy()


def make_occupancy_rare() -> Occupancy:
    """Detection starts rare (intercept -4: p ~ 0.02 a camera-trap night), as the survey's
    pilot estimate initialised it."""
    torch.manual_seed(0)
    m = Occupancy()
    with torch.no_grad():
        m.det.bias.fill_(-4.0)
        m.det.weight.mul_(0.1)
    return m


def camera_survey(g: torch.Generator, n: int = 32, visits: int = 8, bad: int | None = None,
                  busy: int = 0, extreme: bool = False, rate: float = 0.3,
                  habitat: float = 0.0, missed: int = 0):
    """Site covariates, visit covariates, detection histories (n, visits), each visit a detection with probability ``rate`` at
    an occupied site; ``habitat``: how strongly the first covariate decides occupancy (0: 60%
    of sites occupied at random); ``missed``: site ``bad``'s last that many visits were not
    made (NaN, an unbalanced design). ``busy``: that many
    detections at site ``bad`` (a camera at a feeding station); ``extreme``: site ``bad``'s
    covariates in raw units (forest cover in %, elevation in metres: unstandardised), undetected there."""
    site_x = torch.randn(n, 3, generator=g)
    visit_x = torch.randn(n, visits, 2, generator=g)
    y = (torch.rand(n, visits, generator=g) < rate).float()
    occupied = torch.sigmoid(habitat * site_x[:, 0]) if habitat else torch.full((n,), 0.6)
    y[torch.rand(n, generator=g) < 1 - occupied] = 0.0  # unoccupied sites
    if bad is not None and busy:
        y[bad] = 0.0
        y[bad, :busy] = 1.0
    if bad is not None and missed:
        y[bad, -missed:] = float("nan")
    if bad is not None and extreme:
        site_x[bad] = torch.tensor([95.0, 2400.0, 60.0])
        y[bad] = 0.0
    return site_x, visit_x, y


def occupancy_nll_product(occ_logit, det_logit, y):
    """The textbook likelihood: psi * prod p^y (1-p)^(1-y) + (1 - psi) * I(never detected)."""
    psi, p = torch.sigmoid(occ_logit), torch.sigmoid(det_logit)
    hist = (p ** y * (1 - p) ** (1 - y)).prod(1)  # the bug: underflows over many visits
    never = (y.sum(1) == 0).float()
    return -torch.log(psi * hist + (1 - psi) * never).sum()


def occupancy_nll_log1m(occ_logit, det_logit, y):
    """Log space for the detections, but log(psi) and log(1 - psi) from the probability."""
    psi = torch.sigmoid(occ_logit)
    log_hist = (y * F.logsigmoid(det_logit) + (1 - y) * F.logsigmoid(-det_logit)).sum(1)
    never = y.sum(1) == 0
    occupied = torch.log(psi) + log_hist
    absent = torch.log(1 - psi)  # the bug: psi rounds to 1 (float32; bf16 far sooner)
    ll = torch.where(never, torch.logaddexp(occupied, absent), occupied)
    return -ll.sum()


def occupancy_nll(occ_logit, det_logit, y):
    """The stable form: logsigmoid for both branches, -inf for the unoccupied branch of a site
    with detections, the branches combined by logsumexp (the healthy version)."""
    log_hist = (y * F.logsigmoid(det_logit) + (1 - y) * F.logsigmoid(-det_logit)).sum(1)
    never = y.sum(1) == 0
    absent = F.logsigmoid(-occ_logit).masked_fill(~never, float("-inf"))
    branches = torch.stack([F.logsigmoid(occ_logit) + log_hist, absent], -1)
    return -torch.logsumexp(branches, -1).sum()


# ---------------------------------------------------------------------------------------------
# hierarchical multi-species model with a spatial random effect, fitted by LBFGS


class MultiSpeciesGrid(nn.Module):
    """Per-species slopes around a community mean, a random effect per grid cell; returns the
    Bernoulli logits (sites, species) and the prior's log-density."""

    def __init__(self, n_species: int = 6, n_cov: int = 3, grid: int = 4,
                 land: torch.Tensor | None = None):
        super().__init__()
        land = torch.ones(grid, grid, dtype=torch.bool) if land is None else land
        self.register_buffer("adjacency", rook_adjacency(land))
        self.mu = nn.Parameter(torch.zeros(n_cov))
        self.log_sigma = nn.Parameter(torch.zeros(()))
        self.beta = nn.Parameter(0.1 * torch.randn(n_species, n_cov))
        self.alpha = nn.Parameter(torch.zeros(n_species))
        self.cell = nn.Parameter(torch.zeros(grid * grid))

    def forward(self, x, cell):
        logits = x @ self.beta.T + self.alpha + self.cell[cell][:, None]
        sigma = self.log_sigma.exp()
        prior = (-0.5 * ((self.beta - self.mu) / sigma) ** 2 - self.log_sigma).sum()
        return logits, prior + self.car_prior()

    def car_prior(self):
        """An intrinsic CAR prior on the cells: each cell's effect around the mean of its
        land neighbours, weighted by their number."""
        deg = self.adjacency.sum(1)
        mean = self.adjacency @ self.cell / deg  # the bug: an island cell has no neighbour
        return -0.5 * (deg * (self.cell - mean) ** 2).sum() - 0.5e-3 * self.cell.sum() ** 2


def rook_adjacency(land: torch.Tensor) -> torch.Tensor:
    """The rook (4-neighbour) adjacency of a grid's cells, between land cells only."""
    g = land.shape[0]
    a = torch.zeros(g * g, g * g)
    for i in range(g):
        for j in range(g):
            for di, dj in ((0, 1), (1, 0), (0, -1), (-1, 0)):
                k, m = i + di, j + dj
                if 0 <= k < g and 0 <= m < g and land[i, j] and land[k, m]:
                    a[i * g + j, k * g + m] = 1.0
    return a


def make_multispecies() -> MultiSpeciesGrid:
    torch.manual_seed(0)
    return MultiSpeciesGrid()


def make_multispecies_island() -> MultiSpeciesGrid:
    """A coastline grid: cell (0, 3) is land whose every neighbour is sea (an island)."""
    torch.manual_seed(0)
    land = torch.ones(4, 4, dtype=torch.bool)
    land[0, 2] = land[1, 3] = False
    return MultiSpeciesGrid(land=land)


def survey(g: torch.Generator, n: int = 64, n_species: int = 6, grid: int = 4):
    x = torch.randn(n, 3, generator=g)
    cell = torch.randint(0, grid * grid, (n,), generator=g)
    truth = torch.randn(n_species, 3, generator=g)
    y = (torch.rand(n, n_species, generator=g) < torch.sigmoid(x @ truth.T)).float()
    return x, cell, y


def joint_nll(logits, log_prior, y):
    return F.binary_cross_entropy_with_logits(logits, y, reduction="sum") - log_prior


# ---------------------------------------------------------------------------------------------
# several regions, each integral the region's area times the mean intensity at its background


def regional_ppp_loss(eta, y, region, area):
    """The point process over ``len(area)`` regions (a spatial-block design): each region's
    integral is its area times the mean intensity at its own background points."""
    bg = y == 0
    lam = eta.exp()
    total = torch.zeros_like(area).index_add(0, region[bg], lam[bg])
    count = torch.zeros_like(area).index_add(0, region[bg], torch.ones_like(lam[bg]))
    integral = area * total / count  # the bug: a region with no background point in the batch
    return -eta[~bg].sum() + integral.sum()


def regional_points(g: torch.Generator, n: int = 64, regions: int = 4, empty: int | None = None):
    """Points of ``regions`` regions, a quarter of them presences; ``empty``: that region's
    points are all presences (its background layer was clipped away by a coastline mask)."""
    x = landscape(g, n)
    y = (torch.rand(n, generator=g) < 0.25).float()
    region = torch.randint(0, regions, (n,), generator=g)
    if empty is not None:
        y[region == empty] = 1.0
    return x, y, region, torch.full((regions,), 25.0)


def occupancy_nll_missing(occ_logit, det_logit, y):
    """The stable likelihood over an unbalanced design: visits not made are NaN in ``y`` (as
    unmarked stores them) and masked out of the detection history."""
    done = ~torch.isnan(y)
    per_visit = y * F.logsigmoid(det_logit) + (1 - y) * F.logsigmoid(-det_logit)
    log_hist = (per_visit * done).sum(1)  # the bug: NaN * 0 is NaN, the mask does not drop it
    never = torch.nansum(y, 1) == 0
    absent = F.logsigmoid(-occ_logit).masked_fill(~never, float("-inf"))
    branches = torch.stack([F.logsigmoid(occ_logit) + log_hist, absent], -1)
    return -torch.logsumexp(branches, -1).sum()


def standardise_batch(items):
    """A collate_fn standardising each batch's covariates with the batch's own statistics
    (the bug: a covariate one value in the whole batch has a std of 0)."""
    x, y, w = (torch.stack(t) for t in zip(*items))
    return (x - x.mean(0)) / x.std(0), y, w


def make_ppp_unscaled() -> PoissonSDM:
    """The point process whose inputs come standardised from the data pipeline."""
    torch.manual_seed(0)
    return PoissonSDM(torch.zeros(N_COV), torch.ones(N_COV))
