"""Synthetic tabular data generators written the way SDV's CTGAN / TVAE code writes them
(sdv-dev/CTGAN's ``DataTransformer``, ``DataSampler``, ``Generator``, ``Discriminator``,
``TVAE``): the factories, losses and data of ``test_tabular_synthesis.py``.

- ``customers``: a pandas-like table (a dict of named columns): ``income`` (bimodal),
  ``balance`` (zero-inflated: a third of the customers hold exactly 0), ``products`` (1, 2
  or 3: a continuous column of few values, each mode with sigma 0), ``region`` (4
  categories).
- ``ModeNormalizer``: mode-specific normalisation of one continuous column: a mixture fitted
  per column (k-means-style modes, each with its mean and std), a mode sampled per value from
  its responsibilities, the value encoded as ``(x - mu_k) / (4 * sigma_k)`` beside the mode's
  one-hot. ``eps`` guards ``sigma_k`` (a spike of equal values makes a mode with sigma 0).
- ``DataTransformer``: the columns side by side, with their spans (``"alpha"`` and
  ``"softmax"``) in the encoded row.
- ``log_frequency``: training-by-sampling's log category frequencies of a shard.
- ``Generator``: CTGAN's residual generator on ``cat(z, cond)``, the outputs activated span by
  span (``tanh`` for an alpha, ``F.gumbel_softmax(..., tau=self.tau)`` for a one-hot);
  ``Discriminator``: PacGAN's critic (``pac`` rows packed into one), LeakyReLU + Dropout.
- ``WGANGPLoss``: the critic loss ``E[D(fake)] - E[D(real)] + lambda * (||grad D(x_hat)||_2
  - 1)^2`` at interpolates, computed inside the loss (it holds the critic);
  ``GeneratorLoss``: ``-E[D(fake)]`` plus CTGAN's conditional cross-entropy.
- ``TVAE`` + ``TVAELoss``: the encoder's ``(mu, logvar)``, the decoder's output and its
  per-column ``sigma`` parameter; the ELBO with ``log(sigma)`` and ``exp(logvar)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MODES, REGIONS, Z, HIDDEN, PAC = 3, 4, 8, 16, 4
CONTINUOUS = ("income", "balance", "products")


def customers(n: int = 256, seed: int = 0) -> dict[str, torch.Tensor]:
    """The raw table: income (two populations), balance (a third exactly 0), region."""
    g = torch.Generator().manual_seed(seed)
    high = torch.rand(n, generator=g) < 0.3
    income = torch.where(high, 9e4 + 1e4 * torch.randn(n, generator=g),
                         3e4 + 5e3 * torch.randn(n, generator=g))
    balance = torch.rand(n, generator=g) * 5e3 + 2e3
    balance[torch.rand(n, generator=g) < 0.33] = 0.0
    products = torch.randint(1, 4, (n,), generator=g).float()
    region = torch.randint(0, REGIONS, (n,), generator=g)
    return {"income": income, "balance": balance, "products": products, "region": region}


class ModeNormalizer:
    """One continuous column: MODES modes (means from quantiles, refined by k-means steps)."""

    def __init__(self, eps: float = 1e-6):
        self.eps = eps

    def fit(self, x: torch.Tensor) -> ModeNormalizer:
        mu = torch.quantile(x, torch.linspace(0.1, 0.9, MODES))
        for _ in range(10):
            k = (x[:, None] - mu).abs().argmin(1)
            mu = torch.stack([x[k == j].mean() if (k == j).any() else mu[j]
                              for j in range(MODES)])
        self.mu = mu
        self.sigma = torch.stack([x[k == j].std(unbiased=False) if (k == j).any()
                                  else torch.tensor(1.0) for j in range(MODES)])
        return self

    def transform(self, x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        s = self.sigma.clamp_min(1e-3)  # the mixture's own regularised covariance
        logp = -0.5 * ((x[:, None] - self.mu) / s) ** 2 - torch.log(s)
        k = torch.multinomial(torch.softmax(logp, 1), 1, generator=g)[:, 0]
        alpha = (x - self.mu[k]) / (4 * (self.sigma[k] + self.eps))
        return torch.cat([alpha[:, None], F.one_hot(k, MODES).float()], 1)


class DataTransformer:
    """CTGAN's transformer: per column an alpha + mode one-hot, or a category one-hot."""

    def __init__(self, eps: float = 1e-6, eps_of: dict[str, float] | None = None):
        self.eps = {c: (eps_of or {}).get(c, eps) for c in CONTINUOUS}  # a column's own eps

    def fit(self, table: dict[str, torch.Tensor]) -> DataTransformer:
        self.norms = {c: ModeNormalizer(self.eps[c]).fit(table[c]) for c in CONTINUOUS}
        return self

    def transform(self, table, seed: int = 0) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        parts = [self.norms[c].transform(table[c], g) for c in CONTINUOUS]
        return torch.cat(parts + [F.one_hot(table["region"], REGIONS).float()], 1)


SPANS = [span for c in range(len(CONTINUOUS))
         for span in ((c * (1 + MODES), c * (1 + MODES) + 1, "alpha"),
                      (c * (1 + MODES) + 1, (c + 1) * (1 + MODES), "softmax"))]
SPANS.append((SPANS[-1][1], SPANS[-1][1] + REGIONS, "softmax"))
DATA_DIM = SPANS[-1][1]
REGION_SPAN = SPANS[-1][:2]


def log_frequency(encoded: torch.Tensor) -> torch.Tensor:
    """Training-by-sampling's log category frequencies of the region column in a shard."""
    lo, hi = REGION_SPAN
    return torch.log(encoded[:, lo:hi].sum(0) / len(encoded))


def sample_cond(log_freq: torch.Tensor, n: int, g: torch.Generator) -> torch.Tensor:
    """A condition per row: a region drawn with probabilities from the log frequencies."""
    p = torch.softmax(log_freq, 0)
    return F.one_hot(torch.multinomial(p, n, True, generator=g), REGIONS).float()


class Residual(nn.Module):
    def __init__(self, i: int, o: int):
        super().__init__()
        self.fc, self.bn = nn.Linear(i, o), nn.BatchNorm1d(o)

    def forward(self, x):
        return torch.cat([F.relu(self.bn(self.fc(x))), x], 1)


class Generator(nn.Module):
    """CTGAN's generator; ``tau`` is the gumbel-softmax temperature the loop may anneal."""

    def __init__(self, tau: float = 0.2):
        super().__init__()
        self.tau = tau
        self.seq = nn.Sequential(Residual(Z + REGIONS, HIDDEN), Residual(Z + REGIONS + HIDDEN,
                                                                         HIDDEN))
        self.out = nn.Linear(Z + REGIONS + 2 * HIDDEN, DATA_DIM)

    def forward(self, z, cond):
        raw = self.out(self.seq(torch.cat([z, cond], 1)))
        parts = []
        for lo, hi, kind in SPANS:
            if kind == "alpha":
                parts.append(torch.tanh(raw[:, lo:hi]))
            else:
                parts.append(F.gumbel_softmax(raw[:, lo:hi], tau=self.tau, dim=1))
        return torch.cat(parts, 1), raw


class Discriminator(nn.Module):
    """PacGAN critic: ``pac`` rows packed into one of ``pac * dim`` features."""

    def __init__(self, hidden: int = HIDDEN, pac: int = PAC, dropout: float = 0.5):
        super().__init__()
        self.pac = pac
        self.seq = nn.Sequential(nn.Linear((DATA_DIM + REGIONS) * pac, hidden),
                                 nn.LeakyReLU(0.2), nn.Dropout(dropout),
                                 nn.Linear(hidden, hidden), nn.LeakyReLU(0.2), nn.Dropout(dropout),
                                 nn.Linear(hidden, 1))

    def forward(self, x):
        return self.seq(x.reshape(-1, x.shape[1] * self.pac))


class WGANGPLoss(nn.Module):
    """The critic's loss with CTGAN's gradient penalty, at interpolates of the packs."""

    def __init__(self, critic: nn.Module, lam: float = 10.0, eps: float = 1e-12):
        super().__init__()
        self.critic, self.lam, self.eps = critic, lam, eps

    def forward(self, d_real, d_fake, real, fake):
        alpha = torch.rand(real.shape[0] // PAC, 1, 1).repeat(1, PAC, real.shape[1])
        alpha = alpha.reshape(-1, real.shape[1])
        x_hat = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
        grad = torch.autograd.grad(self.critic(x_hat).sum(), x_hat, create_graph=True)[0]
        grad = grad.reshape(-1, PAC * real.shape[1])
        norm = torch.sqrt((grad ** 2).sum(1) + self.eps)
        self.last_norm = norm.detach()  # (logged per pack, as CTGAN logs its penalty)
        penalty = ((norm - 1) ** 2).mean()
        return d_fake.mean() - d_real.mean() + self.lam * penalty


def cond_loss(raw: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
    """CTGAN's conditional loss: the generator's region logits should give the condition."""
    lo, hi = REGION_SPAN
    return F.cross_entropy(raw[:, lo:hi], cond.argmax(1))


class GeneratorLoss(nn.Module):
    """``-E[D(fake)]`` plus the conditional loss; holds the critic."""

    def __init__(self, critic: nn.Module):
        super().__init__()
        self.critic = critic

    def forward(self, fake, raw, cond):
        return -self.critic(torch.cat([fake, cond], 1)).mean() + cond_loss(raw, cond)


class GeneratorLossOnOutputs(GeneratorLoss):
    """The conditional loss taken on the activated outputs (the gumbel-softmax samples'
    ``log``) instead of the logits: ``-sum(cond * log(fake_span))``."""

    def forward(self, fake, raw, cond):
        lo, hi = REGION_SPAN
        ce = -(cond * torch.log(fake[:, lo:hi])).sum(1).mean()
        return -self.critic(torch.cat([fake, cond], 1)).mean() + ce


class TVAE(nn.Module):
    """TVAE: encoder to ``(mu, logvar)``, decoder with a learned ``sigma`` per column."""

    def __init__(self, latent: int = 4):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(DATA_DIM, HIDDEN), nn.ReLU(),
                                     nn.Linear(HIDDEN, 2 * latent))
        self.decoder = nn.Sequential(nn.Linear(latent, HIDDEN), nn.ReLU(),
                                     nn.Linear(HIDDEN, DATA_DIM))
        self.sigma = nn.Parameter(torch.ones(DATA_DIM) * 0.1)

    def forward(self, x):
        mu, logvar = self.encoder(x).chunk(2, 1)
        std = torch.exp(0.5 * logvar)
        z = mu + torch.randn_like(std) * std
        return self.decoder(z), self.sigma, mu, logvar


class TVAELoss(nn.Module):
    """TVAE's ``_loss_function``: Gaussian terms with ``log(sigma)`` for the alphas,
    cross-entropy for the one-hots, and the KL divergence."""

    def __init__(self, loss_factor: float = 2.0):
        super().__init__()
        self.loss_factor = loss_factor

    def forward(self, recon, sigmas, mu, logvar, x):
        terms = []
        for lo, hi, kind in SPANS:
            if kind == "alpha":
                std = sigmas[lo]
                eq = x[:, lo] - torch.tanh(recon[:, lo])
                terms.append((eq ** 2 / 2 / std ** 2).sum())
                terms.append(torch.log(std) * x.size(0))
            else:
                terms.append(F.cross_entropy(recon[:, lo:hi], x[:, lo:hi].argmax(1),
                                             reduction="sum"))
        kld = -0.5 * torch.sum(1 + logvar - mu ** 2 - logvar.exp())
        return (sum(terms) * self.loss_factor + kld) / x.size(0)


def make_tvae() -> TVAE:
    torch.manual_seed(0)
    return TVAE()


def make_generator() -> Generator:
    torch.manual_seed(1)
    return Generator()


def make_critic() -> Discriminator:
    torch.manual_seed(2)
    return Discriminator()


def make_narrow_critic() -> Discriminator:
    """A critic two units wide: Dropout(0.5) may drop both units of a layer for a pack."""
    torch.manual_seed(2)
    return Discriminator(hidden=2)
