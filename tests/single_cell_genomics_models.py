"""Single-cell VAEs written in plain torch the way scVI / scANVI / totalVI code writes them, for
``test_single_cell_genomics``.

- ``SCVI``: an encoder over ``log1p`` counts with the batch one-hot concatenated (scVI's
  ``n_cat_list`` covariates), ``q(z|x)`` with ``var = exp(.) + 1e-4``, the observed library
  ``log(x.sum(1))`` as the library (``use_observed_lib_size``), a decoder whose softmax over
  genes times the library is the negative binomial's mean, gene-wise dispersion
  ``theta = exp(px_r)`` (or ``gene-cell``: a linear head of the decoder) and zero-inflation
  logits; the ZINB log-likelihood written out (``log_zinb_positive``), with or without scVI's
  ``eps``.
- ``zinb_elbo`` / ``ELBO``: the negative ELBO with the KL warm-up weight the loop anneals.
- ``SCANVI`` / ``SCANVIELBO``: a cell-type classifier on z trained on the labelled cells;
  ``SCVILatentLibrary``: the library as a latent against a per-batch ``Normal`` prior;
  ``NBWhereELBO``: a negative binomial ELBO guarding ``x log mu`` with ``torch.where``.
- ``counts``: a sparse UMI matrix (torch COO) and a DataLoader over its cells whose collate
  densifies each minibatch, as AnnData-backed loaders do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

N_GENES, N_BATCHES, N_LATENT = 40, 2, 6


class FCLayers(nn.Module):
    """scVI's FCLayers: Linear, BatchNorm (eps 1e-3, momentum 0.01), ReLU, Dropout, with the
    covariates' one-hot concatenated to the input."""

    def __init__(self, n_in: int, n_out: int, n_cat: int):
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(n_in + n_cat, n_out),
                                   nn.BatchNorm1d(n_out, momentum=0.01, eps=1e-3),
                                   nn.ReLU(), nn.Dropout(0.1))

    def forward(self, x, cat):
        return self.layer(torch.cat([x, cat], dim=-1))


class Encoder(nn.Module):
    """q(z | x, s): the mean and the variance ``exp(.) + var_eps`` of a diagonal normal."""

    def __init__(self, n_in: int, n_out: int, n_cat: int, hidden: int = 32):
        super().__init__()
        self.encoder = FCLayers(n_in, hidden, n_cat)
        self.mean_encoder = nn.Linear(hidden, n_out)
        self.var_encoder = nn.Linear(hidden, n_out)

    def forward(self, x, cat):
        q = self.encoder(x, cat)
        q_m = self.mean_encoder(q)
        q_v = torch.exp(self.var_encoder(q)) + 1e-4
        z = q_m + q_v.sqrt() * torch.randn_like(q_m)
        return q_m, q_v, z


class DecoderSCVI(nn.Module):
    """p(x | z, s): the softmax over genes (``px_scale``), times the library (``px_rate``),
    the zero-inflation logits, and in ``gene-cell`` mode the dispersion's log."""

    def __init__(self, n_in: int, n_out: int, n_cat: int, hidden: int = 32,
                 gene_mask: torch.Tensor | None = None):
        super().__init__()
        self.px_decoder = FCLayers(n_in, hidden, n_cat)
        self.px_scale_decoder = nn.Linear(hidden, n_out)
        self.px_r_decoder = nn.Linear(hidden, n_out)
        self.px_dropout_decoder = nn.Linear(hidden, n_out)
        # genes outside a targeted panel: never measured, their logits filled with -inf
        self.register_buffer("gene_mask", gene_mask if gene_mask is not None
                             else torch.ones(n_out, dtype=torch.bool))

    def forward(self, z, library, cat):
        px = self.px_decoder(z, cat)
        logits = self.px_scale_decoder(px).masked_fill(~self.gene_mask, float("-inf"))
        px_scale = torch.softmax(logits, dim=-1)
        px_rate = torch.exp(library) * px_scale
        return px_scale, self.px_r_decoder(px), px_rate, self.px_dropout_decoder(px)


class SCVI(nn.Module):
    """scVI's VAE module (``dispersion="gene"`` or ``"gene-cell"``, ``log_variational``,
    the observed library size)."""

    def __init__(self, dispersion: str = "gene", log_variational: bool = True,
                 scale_genes: bool = False, gene_mask: torch.Tensor | None = None,
                 n_batches: int = N_BATCHES):
        super().__init__()
        self.dispersion, self.log_variational = dispersion, log_variational
        self.scale_genes, self.n_batches = scale_genes, n_batches
        self.px_r = nn.Parameter(torch.randn(N_GENES))
        self.z_encoder = Encoder(N_GENES, N_LATENT, n_batches)
        self.decoder = DecoderSCVI(N_LATENT, N_GENES, n_batches, gene_mask=gene_mask)

    def forward(self, x, batch_index):
        cat = F.one_hot(batch_index, self.n_batches).float()
        library = torch.log(x.sum(1)).unsqueeze(1)  # use_observed_lib_size
        x_ = torch.log1p(x) if self.log_variational else x
        if self.scale_genes:  # standardise each gene over the minibatch
            x_ = (x_ - x_.mean(0)) / x_.std(0)
        qz_m, qz_v, z = self.z_encoder(x_, cat)
        _, px_r, px_rate, px_dropout = self.decoder(z, library, cat)
        if self.dispersion == "gene":
            px_r = self.px_r.expand_as(px_rate)
        theta = torch.exp(px_r)
        kl_z = 0.5 * (qz_v + qz_m.pow(2) - 1 - torch.log(qz_v)).sum(1)
        return px_rate, theta, px_dropout, kl_z


def log_zinb_positive(x, mu, theta, pi, eps: float):
    """scVI's ``log_zinb_positive``; ``pi`` the zero-inflation logits. ``eps = 0`` is the
    textbook formula as hand-written ports copy it."""
    softplus_pi = F.softplus(-pi)
    log_theta_eps = torch.log(theta + eps)
    log_theta_mu_eps = torch.log(theta + mu + eps)
    pi_theta_log = -pi + theta * (log_theta_eps - log_theta_mu_eps)
    case_zero = F.softplus(pi_theta_log) - softplus_pi
    mul_case_zero = (x < eps + 1e-8).float() * case_zero
    case_non_zero = (-softplus_pi + pi_theta_log + x * (torch.log(mu + eps) - log_theta_mu_eps)
                     + torch.lgamma(x + theta) - torch.lgamma(theta) - torch.lgamma(x + 1))
    mul_case_non_zero = (x > eps + 1e-8).float() * case_non_zero
    return mul_case_zero + mul_case_non_zero


class ELBO(nn.Module):
    """The negative ELBO per cell, averaged; ``kl_weight`` annealed by the loop (KL warm-up)."""

    def __init__(self, eps: float = 1e-8):
        super().__init__()
        self.eps, self.kl_weight = eps, 0.0

    def forward(self, px_rate, theta, px_dropout, kl_z, x):
        rec = -log_zinb_positive(x, px_rate, theta, px_dropout, self.eps).sum(-1)
        return (rec + self.kl_weight * kl_z).mean()


def make_scvi() -> SCVI:
    torch.manual_seed(0)
    return SCVI()


def make_scvi_gene_cell_raw() -> SCVI:
    """``gene-cell`` dispersion with ``log_variational=False``: raw counts into the encoder."""
    torch.manual_seed(0)
    return SCVI(dispersion="gene-cell", log_variational=False)


def make_scvi_scaled() -> SCVI:
    torch.manual_seed(0)
    return SCVI(scale_genes=True)


def panel_mask() -> torch.Tensor:
    mask = torch.ones(N_GENES, dtype=torch.bool)
    mask[-8:] = False
    return mask


def make_scvi_panel() -> SCVI:
    """A targeted panel: the last 8 genes of the reference were not measured."""
    torch.manual_seed(0)
    return SCVI(gene_mask=panel_mask())


# ---------------------------------------------------------------------------------------------
# data: a sparse UMI matrix, densified per minibatch


def counts(n_cells: int = 64, seed: int = 0, zero_cell: int | None = None,
           sentinel_cell: int | None = None, silent_gene: int | None = None,
           huge_cell: int | None = None, panel: bool = False,
           nan_cell: int | None = None, singleton_batch: int | None = None):
    """A sparse (COO) cells x genes UMI matrix (negative binomial draws) and batch labels.

    ``zero_cell``: a cell with no counts (an empty droplet that passed QC);
    ``sentinel_cell``: a row reindexed onto the reference genes with ``fill_value=-1`` (the
    failed merge's sentinel) in the genes it lacked; ``silent_gene``: a gene no cell expresses;
    ``huge_cell``: a cell whose counts were multiplied by 1e4 (a doublet of an unfiltered
    ambient-RNA-corrected matrix, stored as CPM-like numbers); ``panel``: zeros in the genes
    outside the panel; ``nan_cell``: a cell whose counts of 3 genes are NaN (a
    ``scanpy.pp.normalize_total`` of an all-zero row, written back into ``.X``)."""
    g = torch.Generator().manual_seed(seed)
    rate = torch.rand(N_GENES, generator=g) * 3 + 0.05
    lib = torch.randint(200, 2000, (n_cells, 1), generator=g).float()
    mu = lib * rate / rate.sum()
    x = torch.poisson(mu * torch.rand(n_cells, N_GENES, generator=g) * 2, generator=g)
    # the last 4 genes: ambient RNA, Poisson at a rate of 0.5 whatever the library
    x[:, -4:] = torch.poisson(torch.full((n_cells, 4), 0.5), generator=g)
    if panel:
        x[:, ~panel_mask()] = 0
    if silent_gene is not None:
        x[:, silent_gene] = 0
    if zero_cell is not None:
        x[zero_cell] = 0
    if huge_cell is not None:
        x[huge_cell] = x[huge_cell] * 1e4
    if sentinel_cell is not None:
        x[sentinel_cell, N_GENES // 2:] = -1
    if nan_cell is not None:
        x[nan_cell, 3:6] = float("nan")
    batch = torch.arange(n_cells) % N_BATCHES
    if singleton_batch is not None:
        batch[singleton_batch] = N_BATCHES
    return x.to_sparse(), batch


def loader(x_sparse, batch, batch_size: int = 16) -> DataLoader:
    """Minibatches of cell indices, densified from the sparse matrix by the collate."""
    def collate(idx):
        idx = torch.tensor(idx)
        return torch.index_select(x_sparse, 0, idx).to_dense(), batch[idx]

    return DataLoader(range(batch.numel()), batch_size=batch_size, shuffle=False,
                      collate_fn=collate)


def moment_dispersion(x: torch.Tensor) -> torch.Tensor:
    """Each gene's negative binomial dispersion by the method of moments,
    ``theta = mean^2 / (var - mean)``, floored at 0.1 (genes with var <= mean: Poisson-like)."""
    m, v = x.mean(0), x.var(0)
    return torch.where(v > m, m.pow(2) / (v - m), torch.full_like(m, 1e3)).clamp_min(0.1)


def make_scvi_moment_init() -> SCVI:
    """px_r initialised from the data's moment estimates, as a warm start; the bug: theta
    itself is copied into ``px_r``, which the model exponentiates (``log`` forgotten)."""
    torch.manual_seed(0)
    model = SCVI()
    with torch.no_grad():
        model.px_r.copy_(moment_dispersion(counts()[0].to_dense()))
    return model


def make_scvi_moment_log() -> SCVI:
    """The same warm start with the log taken, but without the floor: a gene whose variance
    is below its mean (Poisson-like, under-dispersed by chance) has a negative moment
    estimate, whose log is NaN."""
    torch.manual_seed(0)
    model = SCVI()
    x = counts()[0].to_dense()
    m, v = x.mean(0), x.var(0)
    with torch.no_grad():
        model.px_r.copy_(torch.log(m.pow(2) / (v - m)))
    return model


# ---------------------------------------------------------------------------------------------
# scANVI: a classifier of cell types on z, trained on the labelled (reference) cells


class SCANVI(SCVI):
    def __init__(self, n_labels: int = 4):
        super().__init__()
        self.classifier = nn.Sequential(nn.Linear(N_LATENT, 16), nn.ReLU(), nn.Linear(16, n_labels))

    def forward(self, x, batch_index):
        cat = F.one_hot(batch_index, N_BATCHES).float()
        library = torch.log(x.sum(1)).unsqueeze(1)
        qz_m, qz_v, z = self.z_encoder(torch.log1p(x), cat)
        _, _, px_rate, px_dropout = self.decoder(z, library, cat)
        theta = torch.exp(self.px_r).expand_as(px_rate)
        kl_z = 0.5 * (qz_v + qz_m.pow(2) - 1 - torch.log(qz_v)).sum(1)
        return px_rate, theta, px_dropout, kl_z, self.classifier(qz_m)


class SCANVIELBO(ELBO):
    """The ELBO plus ``classification_ratio`` times the cross-entropy of the labelled cells
    (label -1: unlabelled, a query cell)."""

    def __init__(self, classification_ratio: float = 50.0):
        super().__init__()
        self.classification_ratio = classification_ratio

    def forward(self, px_rate, theta, px_dropout, kl_z, logits, x, y):
        labelled = y >= 0
        ce = F.cross_entropy(logits[labelled], y[labelled])
        return super().forward(px_rate, theta, px_dropout, kl_z, x) + self.classification_ratio * ce


def make_scanvi() -> SCANVI:
    torch.manual_seed(0)
    return SCANVI()


def cell_types(n_cells: int = 64, n_query: int = 16, n_labels: int = 4) -> torch.Tensor:
    """Reference cells' types, then ``n_query`` query cells appended unlabelled (-1)."""
    y = torch.arange(n_cells) % n_labels
    y[n_cells - n_query:] = -1
    return y


# ---------------------------------------------------------------------------------------------
# scVI with a latent library size: q(l | x) against a per-batch prior from the data


class SCVILatentLibrary(SCVI):
    """``use_observed_lib_size=False``: the library is a latent ``l ~ q(l | x, s)``, its KL
    taken against ``Normal(library_log_means[s], library_log_vars[s].sqrt())``, the mean and
    variance of the log library over each batch's cells (scVI's ``_init_library_size``)."""

    def __init__(self, library_log_means: torch.Tensor, library_log_vars: torch.Tensor):
        super().__init__(n_batches=library_log_means.shape[0])
        self.l_encoder = Encoder(N_GENES, 1, self.n_batches)
        self.register_buffer("library_log_means", library_log_means[:, None])
        self.register_buffer("library_log_vars", library_log_vars[:, None])

    def forward(self, x, batch_index):
        cat = F.one_hot(batch_index, self.n_batches).float()
        x_ = torch.log1p(x)
        qz_m, qz_v, z = self.z_encoder(x_, cat)
        ql_m, ql_v, library = self.l_encoder(x_, cat)
        _, _, px_rate, px_dropout = self.decoder(z, library, cat)
        theta = torch.exp(self.px_r).expand_as(px_rate)
        kl_z = 0.5 * (qz_v + qz_m.pow(2) - 1 - torch.log(qz_v)).sum(1)
        prior = torch.distributions.Normal(self.library_log_means[batch_index],
                                           self.library_log_vars[batch_index].sqrt())
        kl_l = torch.distributions.kl_divergence(
            torch.distributions.Normal(ql_m, ql_v.sqrt()), prior).sum(1)
        return px_rate, theta, px_dropout, kl_z + kl_l


def library_prior(x: torch.Tensor, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each batch's mean and (population) variance of the log library, as numpy's defaults
    compute them in scVI's setup."""
    log_lib = torch.log(x.sum(1))
    n = int(batch.max()) + 1
    means = torch.stack([log_lib[batch == b].mean() for b in range(n)])
    return means, torch.stack([log_lib[batch == b].var(correction=0) for b in range(n)])


def make_scvi_latent_library() -> SCVILatentLibrary:
    """The priors of the training data: dataset cell 53 alone in its batch."""
    x, batch = counts(singleton_batch=53)
    torch.manual_seed(0)
    return SCVILatentLibrary(*library_prior(x.to_dense(), batch))


class NBWhereELBO(ELBO):
    """A negative binomial ELBO (no zero-inflation) whose ``x log mu`` term is "made safe" for
    genes with mu = 0 by ``torch.where(x > 0, x * log(mu), 0)``: finite forward, but the
    backward of the dropped branch is ``x / mu = 0 / 0`` there."""

    def forward(self, px_rate, theta, px_dropout, kl_z, x):
        x_log_mu = torch.where(x > 0, x * torch.log(px_rate), torch.zeros_like(px_rate))
        ll = (theta * (torch.log(theta) - torch.log(theta + px_rate)) + x_log_mu
              - x * torch.log(theta + px_rate) + torch.lgamma(x + theta) - torch.lgamma(theta)
              - torch.lgamma(x + 1))
        return (-ll.sum(-1) + self.kl_weight * kl_z).mean()
