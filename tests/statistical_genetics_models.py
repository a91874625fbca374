"""Statistical-genetics models written in plain torch the way PRS / GWAS / REML code writes them,
for ``test_statistical_genetics``.

- ``genotypes``: a 0/1/2 allele-count matrix of individuals by SNPs (Hardy-Weinberg draws from
  per-SNP frequencies), a case-control phenotype from a sparse polygenic score, a quantitative
  trait, covariates (sex, two PCs) and case-control sample weights; plantable faults: a rare
  SNP monomorphic in one batch, a PLINK ``-9`` missing call, VCF ``./.`` calls read as NaN.
  ``loader``: a DataLoader over individuals (no shuffle: dataset row ``16 k + r`` is row ``r``
  of step ``k``).
- ``SNPStandardize``: ``(g - 2p) / sqrt(2p(1-p))`` per SNP, ``p`` the minibatch's allele
  frequency or a reference frequency buffer (with a MAF filter's mask).
- ``PRSNet``: a linear or MLP polygenic-risk head over the standardised SNPs, covariates passed
  into ``forward``. ``CaseControlLoss``: a sample-weighted logistic loss (library or
  hand-written ``exp(eta) / (1 + exp(eta))``) with L1/L2 penalties, or a gene-wise group lasso,
  on the SNP effects of the model it holds.
- ``VarianceComponents`` / ``REMLLoss``: the genomic-relationship kernel ``Z Z^T / m`` of the
  batch, ``V = s_g K + s_e I`` (variances as raw parameters or their logs), its Cholesky, the
  Gaussian negative log-likelihood with a log-variance prior term.
- ``AdmixtureAE`` / ``binomial_nll``: an autoencoder over genotypes for population structure:
  ancestry proportions (softmax) times population allele frequencies, the genotype's binomial
  likelihood as a product over SNPs or a sum of logs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

N_IND, N_SNP, BATCH, GENE = 64, 120, 16, 10


def genotypes(n: int = N_IND, m: int = N_SNP, seed: int = 0, *, mono_in_batch: int | None = None,
              minus9: tuple[int, int] | None = None, nan_calls: list[tuple[int, int]] | None = None,
              monomorphic: int | None = None, related: tuple[int, int] | None = None):
    """``(G, y, trait, covar, w)``. ``mono_in_batch=k``: SNP 7 is rare, its minor alleles all in
    individuals outside step ``k``'s batch; ``minus9=(i, j)``: individual ``i``'s call at SNP
    ``j`` is PLINK's ``-9``, the other calls of the batch at that SNP mostly 0; ``nan_calls``:
    (individual, SNP) calls missing as NaN; ``monomorphic``: a SNP no individual carries;
    ``related=(a, b)``: individuals a..b-1 are relatives a kinship filter excluded (weight 0)."""
    g = torch.Generator().manual_seed(seed)
    p = 0.3 + 0.2 * torch.rand(m, generator=g)
    G = (torch.rand(n, m, 2, generator=g) < p[None, :, None]).sum(-1).float()
    for k in range(n // BATCH):  # every SNP polymorphic in every batch
        rows = G[k * BATCH:(k + 1) * BATCH]
        rows[0, rows.sum(0) == 0] = 1.0
        rows[1, rows.sum(0) == 2 * BATCH] = 1.0
    if mono_in_batch is not None:
        G[:, 7] = 0.0
        G[[k * BATCH + 3 for k in range(n // BATCH) if k != mono_in_batch], 7] = 1.0
    if monomorphic is not None:
        G[:, monomorphic] = 0.0
    if minus9 is not None:
        i, j = minus9
        k = i // BATCH
        G[k * BATCH:(k + 1) * BATCH, j] = 0.0
        G[k * BATCH, j] = 1.0
        G[i, j] = -9.0
    beta = torch.zeros(m)
    beta[torch.randperm(m, generator=g)[:12]] = 0.4 * torch.randn(12, generator=g)
    z = (G - 2 * p) / torch.sqrt(2 * p * (1 - p))
    covar = torch.cat([torch.randint(0, 2, (n, 1), generator=g).float(),
                       torch.randn(n, 2, generator=g)], 1)
    eta = z @ beta + 0.3 * covar[:, 0]
    y = (eta + torch.randn(n, generator=g) > 0.5).float()
    trait = eta + torch.randn(n, generator=g)
    w = torch.where(y == 1, 2.0, 1.0)  # cases up-weighted to the population prevalence
    if related is not None:
        w[related[0]:related[1]] = 0.0
    for i, j in nan_calls or []:
        G[i, j] = float("nan")
    return G, y, trait, covar, w


def loader(G, y, trait, covar, w, batch_size: int = BATCH) -> DataLoader:
    return DataLoader(TensorDataset(G, y, trait, covar, w), batch_size=batch_size, shuffle=False)


def reference_freq(G: torch.Tensor, maf: float = 0.01):
    """Allele frequencies over the whole training set, and the MAF filter's mask."""
    p = torch.nanmean(G, 0) / 2
    return p, torch.minimum(p, 1 - p) >= maf


class SNPStandardize(nn.Module):
    """``(g - 2p) / sqrt(2p(1-p))`` per SNP; ``p`` the batch's allele frequency when no
    reference frequencies are given (the ones computed over the training set)."""

    def __init__(self, freq: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("freq", freq)

    def forward(self, g):
        p = g.mean(0) / 2 if self.freq is None else self.freq
        return (g - 2 * p) / torch.sqrt(2 * p * (1 - p))


class PRSNet(nn.Module):
    """A polygenic risk score: standardised SNPs into a linear (or MLP) head, plus covariates
    (sex, PCs) through their own linear term."""

    def __init__(self, m: int = N_SNP, hidden: int = 0, freq: torch.Tensor | None = None,
                 standardize: bool = True, zero_init: bool = False):
        super().__init__()
        self.std = SNPStandardize(freq) if standardize else nn.Identity()
        self.head = (nn.Linear(m, 1) if not hidden else
                     nn.Sequential(nn.Linear(m, hidden), nn.ReLU(), nn.Linear(hidden, 1)))
        self.covar = nn.Linear(3, 1, bias=False)
        if zero_init:  # PRS effects start at 0, as penalised regression does
            nn.init.zeros_(self.head.weight)
            nn.init.zeros_(self.head.bias)

    def snp_weights(self):
        return self.head.weight if isinstance(self.head, nn.Linear) else self.head[0].weight

    def forward(self, g, covar):
        return (self.head(self.std(g)) + self.covar(covar)).squeeze(-1)


class CaseControlLoss(nn.Module):
    """Sample-weighted case-control logistic loss plus penalties on the SNP effects of the model
    it holds: elastic net (``l1``, ``l2``) or a gene-wise group lasso (SNPs in genes of
    ``GENE``)."""

    def __init__(self, model: PRSNet, l1: float = 1e-4, l2: float = 1e-4, group: float = 0.0,
                 hand_written: bool = False):
        super().__init__()
        self.model, self.l1, self.l2, self.group = model, l1, l2, group
        self.hand_written = hand_written

    def forward(self, eta, y, w):
        if self.hand_written:
            p = torch.exp(eta) / (1 + torch.exp(eta))
            nll = -(y * torch.log(p) + (1 - y) * torch.log(1 - p))
        else:
            nll = F.binary_cross_entropy_with_logits(eta, y, reduction="none")
        loss = (w * nll).sum() / w.sum()
        beta = self.model.snp_weights()
        loss = loss + self.l1 * beta.abs().sum() + self.l2 * beta.pow(2).sum()
        if self.group:
            genes = beta.reshape(-1, GENE)
            loss = loss + self.group * torch.sqrt(genes.pow(2).sum(1)).sum()
        return loss


def make_prs_batch_freq() -> PRSNet:
    torch.manual_seed(0)
    return PRSNet()


def make_prs_reference() -> PRSNet:
    """The healthy pipeline: training-set frequencies, SNPs failing the MAF filter dropped."""
    torch.manual_seed(0)
    p, keep = reference_freq(genotypes()[0])
    return PRSNet(freq=p.where(keep, torch.full_like(p, 0.5)))


def make_prs_raw() -> PRSNet:
    """Raw allele counts into the score (no standardisation), an MLP head."""
    torch.manual_seed(0)
    return PRSNet(standardize=False)


def make_prs_zero() -> PRSNet:
    torch.manual_seed(0)
    p, _ = reference_freq(genotypes()[0])
    return PRSNet(freq=p, zero_init=True)


class VarianceComponents(nn.Module):
    """The GCTA-style model of a quantitative trait ``y = g + e``, ``g ~ N(0, s_g K)``,
    ``e ~ N(0, s_e I)``, ``K = Z Z^T / m`` over the batch: returns the Cholesky factor of
    ``V`` and the variances. ``log_param``: the variances as their logs (``exp`` keeps them
    positive), else as raw parameters."""

    def __init__(self, freq: torch.Tensor, log_param: bool = True):
        super().__init__()
        self.std = SNPStandardize(freq)
        self.log_param = log_param
        init = torch.tensor(0.5)
        self.s_g = nn.Parameter(init.log() if log_param else init.clone())
        self.s_e = nn.Parameter(init.log() if log_param else init.clone())

    def forward(self, g):
        z = self.std(g)
        K = z @ z.T / z.shape[1]
        s_g, s_e = (self.s_g.exp(), self.s_e.exp()) if self.log_param else (self.s_g, self.s_e)
        V = s_g * K + s_e * torch.eye(len(g))
        return torch.linalg.cholesky(V), s_g, s_e


class REMLLoss(nn.Module):
    """Gaussian negative log-likelihood ``log|V| / 2 + y^T V^-1 y / 2`` from the Cholesky factor,
    plus a weak log-normal prior on each variance (``log s`` squared)."""

    def __init__(self, prior: float = 0.01):
        super().__init__()
        self.prior = prior

    def forward(self, L, s_g, s_e, y):
        alpha = torch.linalg.solve_triangular(L, y.unsqueeze(-1), upper=False)
        nll = torch.log(torch.diagonal(L)).sum() + 0.5 * alpha.pow(2).sum()
        return nll / len(y) + self.prior * (torch.log(s_g) ** 2 + torch.log(s_e) ** 2)


def make_reml_raw() -> VarianceComponents:
    torch.manual_seed(0)
    return VarianceComponents(reference_freq(genotypes()[0])[0], log_param=False)


def make_reml_log() -> VarianceComponents:
    torch.manual_seed(0)
    return VarianceComponents(reference_freq(genotypes()[0])[0])


class AdmixtureAE(nn.Module):
    """Neural ADMIXTURE: an encoder over the genotypes to ancestry proportions ``q`` (softmax
    over ``K`` populations) and a decoder of population allele frequencies ``F``; the
    individual's allele frequency at each SNP is ``q @ F``."""

    def __init__(self, m: int = N_SNP, k: int = 3, hidden: int = 32):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(m, hidden), nn.ReLU(), nn.Linear(hidden, k))
        self.freq_logits = nn.Parameter(torch.randn(k, m) * 0.1)

    def forward(self, g):
        q = torch.softmax(self.encoder(g / 2), -1)
        return q @ torch.sigmoid(self.freq_logits)


def binomial_nll(p, g, product: bool = False):
    """The genotype's binomial likelihood ``C(2, g) p^g (1-p)^(2-g)`` over SNPs: as a product of
    the per-SNP probabilities (then its log), or a sum of their logs."""
    comb = torch.where(g == 1, 2.0, 1.0)
    if product:
        lik = torch.prod(comb * p.pow(g) * (1 - p).pow(2 - g), dim=1)
        return -torch.log(lik).mean()
    ll = torch.log(comb) + g * torch.log(p) + (2 - g) * torch.log1p(-p)
    return -ll.sum(1).mean()


class BinomialNLL(nn.Module):
    def __init__(self, product: bool = False):
        super().__init__()
        self.product = product

    def forward(self, p, g):
        return binomial_nll(p, g, self.product)


def make_admixture() -> AdmixtureAE:
    torch.manual_seed(0)
    return AdmixtureAE()


def make_prs_unfiltered() -> PRSNet:
    """Training-set frequencies with no MAF filter: SNP 7 is monomorphic in the training set
    (``genotypes(monomorphic=7)``), its frequency 0."""
    torch.manual_seed(0)
    return PRSNet(freq=reference_freq(genotypes(monomorphic=7)[0])[0])
