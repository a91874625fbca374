"""Deep anomaly detection and one-class models written the way their public repositories write
them; the factories of ``test_anomaly_detection.py``.

- ``DeepSVDD``: lukasruff/Deep-SVDD-PyTorch (``deepSVDD_trainer.py``, ``networks/mlp.py``):
  bias-free ``nn.Linear`` layers, ``BatchNorm1d(eps=1e-4, affine=False)``, leaky ReLU; the
  centre ``c`` the mean of an initial forward pass over the data, kept off zero by ``eps``
  (``init_center_c``), held as a buffer; the one-class loss ``mean(|z - c|^2)`` and the
  soft-boundary loss ``R^2 + 1/nu * mean(max(0, |z - c|^2 - R^2))`` with ``R`` the
  ``1 - nu`` quantile of the distances, set every few epochs after a warm-up (``get_radius``).
- ``DAGMM``: danieltan07/dagmm (``model.py``): a compression autoencoder whose latent is
  concatenated with the relative Euclidean distance ``|x - x'| / |x|`` and cosine similarity of
  the reconstruction; an estimation network giving soft memberships ``gamma``; the GMM's
  ``phi, mu, cov`` from them (``compute_gmm_params``) and the sample energy from the mixture's
  inverse covariances and log-determinants with a small diagonal added (here through
  ``torch.linalg.cholesky``, ``cholesky_inverse`` and the factor's log-diagonal), written as
  ``-log(sum(exp(...)))`` by hand.
- ``NormalisedAE``: an autoencoder whose input is standardised by mean/std buffers set from
  the first batch the forward sees (data-dependent init, as ActNorm and tabular AD code do).
- ``GaussianScore``: a feature extractor and a Gaussian density score of its embeddings
  (PaDiM/"Gaussian AD" style) through ``torch.distributions.MultivariateNormal`` with the
  batch's empirical covariance.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import MultivariateNormal

FEATURES, REP, BATCH = 10, 4, 16
LATENT, GMM_K = 1, 3


def normal_data(g: torch.Generator, n: int = 64):
    """One 'normal' class: points near a low-dimensional manifold in FEATURES dims."""
    basis = torch.randn(3, FEATURES, generator=g)
    return torch.randn(n, 3, generator=g) @ basis + 0.1 * torch.randn(n, FEATURES, generator=g)


# --------------------------------------------------------------------------------------------
# Deep SVDD


class DeepSVDD(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, 32, bias=False)
        self.bn1 = nn.BatchNorm1d(32, eps=1e-4, affine=False)
        self.fc2 = nn.Linear(32, REP, bias=False)
        self.register_buffer("c", torch.zeros(REP))

    def forward(self, x):
        return self.fc2(F.leaky_relu(self.bn1(self.fc1(x))))


@torch.no_grad()
def init_center_c(net, loader, eps: float = 0.1):
    """Ruff's init_center_c: the mean of the initial outputs, coordinates too close to 0 set
    to +-eps (a unit of zero weights would match them trivially)."""
    n_samples, c = 0, torch.zeros(REP)
    net.eval()
    for x in loader:
        outputs = net(x)
        n_samples += outputs.shape[0]
        c += torch.sum(outputs, dim=0)
    net.train()
    c /= n_samples
    c[(abs(c) < eps) & (c < 0)] = -eps
    c[(abs(c) < eps) & (c > 0)] = eps
    return c


def svdd_loss(outputs, c, R, nu: float = 0.1, objective: str = "one-class"):
    dist = torch.sum((outputs - c) ** 2, dim=1)
    if objective == "soft-boundary":
        scores = dist - R ** 2
        return R ** 2 + (1 / nu) * torch.mean(torch.max(torch.zeros_like(scores), scores))
    return torch.mean(dist)


def get_radius(dist, nu: float):
    """Ruff's get_radius: the (1 - nu)-quantile of the distances."""
    return torch.quantile(torch.sqrt(dist), 1 - nu)


def make_svdd():
    torch.manual_seed(0)
    return DeepSVDD()


# --------------------------------------------------------------------------------------------
# DAGMM


def relative_euclidean_distance(a, b):
    return (a - b).norm(2, dim=1) / a.norm(2, dim=1)


class DAGMM(nn.Module):
    def __init__(self, n_gmm: int = GMM_K, latent_dim: int = LATENT, eps: float = 1e-6):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, latent_dim))
        self.decoder = nn.Sequential(nn.Linear(latent_dim, 16), nn.Tanh(), nn.Linear(16, FEATURES))
        self.estimation = nn.Sequential(nn.Linear(latent_dim + 2, 10), nn.Tanh(),
                                        nn.Dropout(p=0.5), nn.Linear(10, n_gmm))
        self.eps = eps
        self.temperature = 1.0  # annealed down by a loop that sharpens the memberships

    def forward(self, x):
        enc = self.encoder(x)
        dec = self.decoder(enc)
        rec_cosine = F.cosine_similarity(x, dec, dim=1)
        rec_euclidean = relative_euclidean_distance(x, dec)
        z = torch.cat([enc, rec_euclidean.unsqueeze(-1), rec_cosine.unsqueeze(-1)], dim=1)
        gamma = F.softmax(self.estimation(z) / self.temperature, dim=1)
        return enc, dec, z, gamma


def compute_gmm_params(z, gamma):
    sum_gamma = torch.sum(gamma, dim=0)
    phi = sum_gamma / gamma.size(0)
    mu = torch.sum(gamma.unsqueeze(-1) * z.unsqueeze(1), dim=0) / sum_gamma.unsqueeze(-1)
    z_mu = z.unsqueeze(1) - mu.unsqueeze(0)
    z_mu_outer = z_mu.unsqueeze(-1) * z_mu.unsqueeze(-2)
    cov = torch.sum(gamma.unsqueeze(-1).unsqueeze(-1) * z_mu_outer, dim=0) \
        / sum_gamma.unsqueeze(-1).unsqueeze(-1)
    return phi, mu, cov


def compute_energy(z, phi, mu, cov, eps: float = 1e-12):
    """The sample energy ``-log sum_k phi_k N(z; mu_k, cov_k)``, written out by hand."""
    d = z.size(1)
    cov_k = cov + eps * torch.eye(d)
    L = torch.linalg.cholesky(cov_k)
    cov_inverse = torch.cholesky_inverse(L)
    log_det = 2 * torch.log(torch.diagonal(L, dim1=-2, dim2=-1)).sum(-1)
    z_mu = z.unsqueeze(1) - mu.unsqueeze(0)
    maha = torch.sum(torch.sum(z_mu.unsqueeze(-1) * cov_inverse.unsqueeze(0), dim=-2) * z_mu,
                     dim=-1)
    log_p = torch.log(phi) - 0.5 * maha - 0.5 * log_det - 0.5 * d * math.log(2 * math.pi)
    sample_energy = -torch.log(torch.sum(torch.exp(log_p), dim=1))
    cov_diag = torch.sum(1 / torch.diagonal(cov_k, dim1=-2, dim2=-1))
    return sample_energy, cov_diag


def compute_energy_inverse(z, phi, mu, cov, eps: float = 1e-12):
    """The original DAGMM's energy: ``torch.inverse`` and the determinant of each component's
    covariance (here ``torch.logdet``), the same mixture written out by hand."""
    d = z.size(1)
    cov_k = cov + eps * torch.eye(d)
    cov_inverse = torch.inverse(cov_k)
    log_det = torch.logdet(cov_k)
    z_mu = z.unsqueeze(1) - mu.unsqueeze(0)
    maha = torch.sum(torch.sum(z_mu.unsqueeze(-1) * cov_inverse.unsqueeze(0), dim=-2) * z_mu,
                     dim=-1)
    log_p = torch.log(phi) - 0.5 * maha - 0.5 * log_det - 0.5 * d * math.log(2 * math.pi)
    sample_energy = -torch.log(torch.sum(torch.exp(log_p), dim=1))
    cov_diag = torch.sum(1 / torch.diagonal(cov_k, dim1=-2, dim2=-1))
    return sample_energy, cov_diag


def dagmm_loss(x, dec, z, gamma, lambda_energy: float = 0.1, lambda_cov_diag: float = 0.005,
               inverse: bool = False):
    recon_error = torch.mean((x - dec) ** 2)
    phi, mu, cov = compute_gmm_params(z, gamma)
    sample_energy, cov_diag = (compute_energy_inverse if inverse else compute_energy)(
        z, phi, mu, cov)
    return recon_error + lambda_energy * torch.mean(sample_energy) + lambda_cov_diag * cov_diag


def dagmm_entropy_loss(x, dec, z, gamma, lambda_entropy: float = 0.1):
    """DAGMM plus the memberships' entropy, to make each record choose one component."""
    entropy = -torch.sum(gamma * torch.log(gamma), dim=1).mean()
    return dagmm_loss(x, dec, z, gamma) + lambda_entropy * entropy


def dagmm_loss_inverse(x, dec, z, gamma):
    return dagmm_loss(x, dec, z, gamma, inverse=True)


def make_dagmm():
    torch.manual_seed(0)
    return DAGMM()


class DAGMMScorer(DAGMM):
    """DAGMM that keeps the mixture of its last training batch in buffers (as its solver keeps
    ``phi, mu, cov`` for the test phase) and, in eval mode, returns each record's energy
    under it."""

    def __init__(self):
        super().__init__()
        self.register_buffer("phi", torch.full((GMM_K,), 1 / GMM_K))
        self.register_buffer("mu", torch.zeros(GMM_K, LATENT + 2))
        self.register_buffer("cov", torch.eye(LATENT + 2).repeat(GMM_K, 1, 1))

    def forward(self, x):
        enc, dec, z, gamma = super().forward(x)
        if self.training:
            with torch.no_grad():
                for buf, value in zip((self.phi, self.mu, self.cov), compute_gmm_params(z, gamma)):
                    buf.copy_(value)
            return enc, dec, z, gamma
        return compute_energy(z, self.phi, self.mu, self.cov)[0]


def make_dagmm_scorer():
    torch.manual_seed(0)
    return DAGMMScorer()


# --------------------------------------------------------------------------------------------
# an autoencoder on standardised features


class Standardize(nn.Module):
    """Mean/std buffers set from the first batch seen in training (data-dependent init)."""

    def __init__(self, n: int, flag_dtype=torch.uint8):
        super().__init__()
        self.register_buffer("mean", torch.zeros(n))
        self.register_buffer("std", torch.ones(n))
        self.register_buffer("initialized", torch.tensor(0, dtype=flag_dtype))

    def forward(self, x):
        if self.training and not self.initialized:
            self.mean.copy_(x.mean(0))
            self.std.copy_(x.std(0))
            self.initialized.fill_(1)
        return (x - self.mean) / self.std


class NormalisedAE(nn.Module):
    def __init__(self, flag_dtype=torch.uint8):
        super().__init__()
        self.norm = Standardize(FEATURES, flag_dtype)
        self.encoder = nn.Sequential(nn.Linear(FEATURES, 8), nn.ReLU(), nn.Linear(8, 3))
        self.decoder = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, FEATURES))

    def forward(self, x):
        x = self.norm(x)
        return self.decoder(self.encoder(x)), x


class ScoredAE(nn.Module):
    """An autoencoder that also returns each record's anomaly score: its reconstruction error
    standardised by running mean/variance buffers the training forward updates (as a
    monitoring head does), the score taken with the statistics as the step found them."""

    def __init__(self, momentum: float = 0.1, var_init: float = 0.0):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(FEATURES, 8), nn.ReLU(), nn.Linear(8, 3))
        self.decoder = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, FEATURES))
        self.momentum = momentum
        self.register_buffer("err_mean", torch.zeros(()))
        self.register_buffer("err_var", torch.full((), var_init))

    def forward(self, x):
        x_hat = self.decoder(self.encoder(x))
        err = ((x - x_hat) ** 2).mean(1)
        score = (err - self.err_mean) / self.err_var.sqrt()
        if self.training:
            with torch.no_grad():
                self.err_mean.lerp_(err.mean(), self.momentum)
                self.err_var.lerp_(err.var(), self.momentum)
        return x_hat, score


def make_scored_ae():
    torch.manual_seed(0)
    return ScoredAE()


def make_scored_ae_var_one():
    torch.manual_seed(0)
    return ScoredAE(var_init=1.0)


def ae_loss(out, target):
    return F.mse_loss(out, target)


def make_normalised_ae():
    torch.manual_seed(0)
    return NormalisedAE()


def make_normalised_ae_float_flag():
    """Its init flag a float buffer (as vector-quantize-pytorch keeps ``initted``)."""
    torch.manual_seed(0)
    return NormalisedAE(torch.float32)


# --------------------------------------------------------------------------------------------
# Gaussian density score of embeddings


class GaussianScore(nn.Module):
    def __init__(self, dim: int = REP, jitter: float = 1e-6):
        super().__init__()
        self.jitter = jitter
        self.features = nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Linear(16, dim),
                                      nn.ReLU())

    def forward(self, x):
        z = self.features(x)
        mu = z.mean(0)
        zc = z - mu
        cov = zc.T @ zc / (z.size(0) - 1) + self.jitter * torch.eye(z.size(1))
        return -MultivariateNormal(mu, covariance_matrix=cov).log_prob(z)


def make_gaussian_score():
    torch.manual_seed(0)
    return GaussianScore()


def make_gaussian_score_nojitter():
    torch.manual_seed(0)
    return GaussianScore(jitter=0.0)


class ForecastScore(nn.Module):
    """A forecaster's density score of the next window (time-series AD): a mean and a
    diagonal Cholesky factor ``softplus(raw_scale)`` per record, through
    ``MultivariateNormal(loc, scale_tril=...)``; returns the distribution."""

    def __init__(self, dim: int = REP):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 2 * dim))
        self.head = nn.Linear(FEATURES, 2 * dim)

    def forward(self, x):
        loc, raw_scale = (self.net(x) + self.head(x)).chunk(2, dim=-1)
        return MultivariateNormal(loc, scale_tril=torch.diag_embed(F.softplus(raw_scale)))


def make_forecast_score():
    torch.manual_seed(0)
    return ForecastScore()
