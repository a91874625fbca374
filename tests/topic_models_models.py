"""Neural topic models written as their public repositories write them, for
``test_topic_models``. Documents are bags of words (count vectors over ``VOCAB`` words) drawn
by a ``DataLoader``.

- ``ProdLDA``: AVITM (Srivastava & Sutton): a VAE over bags of words with the Laplace
  (logistic-normal) approximation of a symmetric Dirichlet prior, the KL in closed form with
  the prior's variance, ``sigma = logvar.exp().sqrt()``, the decoder ``softmax(BN(beta p))``
  and the reconstruction ``-sum(bow * log(recon + 1e-10))``.
- ``NVDM``: Miao et al.'s neural variational document model: a Gaussian posterior over a
  continuous document vector, ``z = mu + exp(logsigma) * eps``, a softmax decoder, the KL to
  N(0, I) in closed form, weighted by a KL-annealing factor the loop passes in.
- ``DirichletVAE``: a Dirichlet posterior ``Dirichlet(softplus(fc(h)))`` whose
  ``rsample()`` feeds the decoder, the KL estimated by Monte Carlo from that sample
  (``q.log_prob(theta) - p.log_prob(theta)``), as the Dirichlet-VAE topic models do.
- ``ETM``: Dieng et al.'s embedded topic model, ``beta = softmax(rho @ alpha^T)`` over the
  vocabulary, the encoder given the normalised bag of words.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import Dirichlet

VOCAB, TOPICS, HIDDEN, DOCS, BATCH, EMBED = 30, 4, 16, 48, 8, 6


class ProdLDA(nn.Module):
    def __init__(self, alpha: float = 1.0):
        super().__init__()
        self.en1 = nn.Linear(VOCAB, HIDDEN)
        self.en2 = nn.Linear(HIDDEN, HIDDEN)
        self.mean_fc = nn.Linear(HIDDEN, TOPICS)
        self.mean_bn = nn.BatchNorm1d(TOPICS)
        self.logvar_fc = nn.Linear(HIDDEN, TOPICS)
        self.logvar_bn = nn.BatchNorm1d(TOPICS)
        self.beta = nn.Linear(TOPICS, VOCAB, bias=False)
        self.beta_bn = nn.BatchNorm1d(VOCAB, affine=False)
        a = torch.full((1, TOPICS), alpha)
        self.register_buffer("prior_mean", (a.log() - a.log().mean(1, keepdim=True))[0])
        var = (1.0 / a) * (1 - 2.0 / TOPICS) + (1.0 / TOPICS ** 2) * (1.0 / a).sum(1, keepdim=True)
        self.register_buffer("prior_var", var[0])

    def forward(self, bow):
        h = F.softplus(self.en2(F.softplus(self.en1(bow))))
        mean = self.mean_bn(self.mean_fc(h))
        logvar = self.logvar_bn(self.logvar_fc(h))
        sigma = logvar.exp().sqrt()  # as AVITM writes it
        z = mean + sigma * torch.randn_like(mean)
        p = F.softmax(z, dim=1)
        recon = F.softmax(self.beta_bn(self.beta(p)), dim=1)
        return recon, mean, logvar


def prodlda_loss(recon, mean, logvar, bow, prior_mean, prior_var):
    nl = -(bow * (recon + 1e-10).log()).sum(1)
    var_division = logvar.exp() / prior_var
    diff = mean - prior_mean
    kld = 0.5 * ((var_division + diff * diff / prior_var + prior_var.log() - logvar).sum(1)
                 - TOPICS)
    return (nl + kld).mean()


def make_prodlda():
    torch.manual_seed(0)
    return ProdLDA()


class NVDM(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(VOCAB, HIDDEN), nn.ReLU(),
                                     nn.Linear(HIDDEN, HIDDEN), nn.ReLU())
        self.mu = nn.Linear(HIDDEN, TOPICS)
        self.logsigma = nn.Linear(HIDDEN, TOPICS)
        self.decoder = nn.Linear(TOPICS, VOCAB)

    def forward(self, bow, kl_weight):
        h = self.encoder(bow)
        mu, logsigma = self.mu(h), self.logsigma(h)
        z = mu + torch.exp(logsigma) * torch.randn_like(mu)
        log_recon = F.log_softmax(self.decoder(z), dim=1)
        rec = -(bow * log_recon).sum(1)
        kld = -0.5 * (1 + 2 * logsigma - mu.pow(2) - torch.exp(2 * logsigma)).sum(1)
        return rec + kl_weight * kld


def nvdm_loss(per_doc):
    return per_doc.mean()


def per_word_loss(per_doc, bow):
    """The per-word bound NVDM's perplexity is the exponential of, trained on directly."""
    return (per_doc / bow.sum(1)).mean()


def make_nvdm():
    torch.manual_seed(0)
    return NVDM()


class DirichletVAE(nn.Module):
    def __init__(self, prior_alpha: float = 0.1, learn_prior: bool = False):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(VOCAB, HIDDEN), nn.Softplus())
        self.alpha_fc = nn.Linear(HIDDEN, TOPICS)
        self.beta = nn.Linear(TOPICS, VOCAB, bias=False)
        alpha = torch.full((TOPICS,), prior_alpha)
        if learn_prior:  # (the prior's concentration learned with the rest, as is)
            self.prior_alpha = nn.Parameter(alpha)
        else:
            self.register_buffer("prior_alpha", alpha)

    def forward(self, bow):
        alpha = F.softplus(self.alpha_fc(self.encoder(bow))) + 1e-3
        q = Dirichlet(alpha, validate_args=False)
        theta = q.rsample()
        log_recon = F.log_softmax(self.beta(theta), dim=1)
        kl = q.log_prob(theta) - Dirichlet(self.prior_alpha).log_prob(theta)  # Monte Carlo KL
        return log_recon, kl


def dvae_loss(log_recon, kl, bow):
    return (-(bow * log_recon).sum(1) + kl).mean()


def make_dvae():
    torch.manual_seed(0)
    return DirichletVAE()


def make_dvae_learned_prior():
    torch.manual_seed(0)
    return DirichletVAE(prior_alpha=1.0, learn_prior=True)


class ETM(nn.Module):
    def __init__(self):
        super().__init__()
        self.rho = nn.Linear(EMBED, VOCAB, bias=False)
        self.alphas = nn.Linear(EMBED, TOPICS, bias=False)
        self.q_theta = nn.Sequential(nn.Linear(VOCAB, HIDDEN), nn.ReLU())
        self.mu_q = nn.Linear(HIDDEN, TOPICS)
        self.logsigma_q = nn.Linear(HIDDEN, TOPICS)

    def forward(self, bows, normalized_bows):
        q = self.q_theta(normalized_bows)
        mu, logsigma = self.mu_q(q), self.logsigma_q(q)
        kld = -0.5 * (1 + logsigma - mu.pow(2) - logsigma.exp()).sum(-1).mean()
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * logsigma)
        theta = F.softmax(z, dim=-1)
        beta = F.softmax(self.alphas(self.rho.weight), dim=0).transpose(1, 0)
        preds = torch.log(torch.mm(theta, beta))
        return -(preds * bows).sum(1).mean() + kld


def make_etm():
    torch.manual_seed(0)
    return ETM()


def corpus(n: int = DOCS, seed: int = 0, empty=(), long=(), length: float = 20.0):
    """``n`` bags of words (Poisson counts over a few topics); the rows in ``empty`` blank,
    those in ``long`` a thousand times longer (a concatenated dump never split)."""
    g = torch.Generator().manual_seed(seed)
    topics = torch.softmax(torch.randn(TOPICS, VOCAB, generator=g) * 2, dim=1)
    mix = torch._sample_dirichlet(torch.full((n, TOPICS), 0.5), generator=g)
    bows = torch.poisson(length * mix @ topics, generator=g)
    bows[list(empty)] = 0
    bows[list(long)] *= 1000
    return bows


def tfidf(bows):
    """A data pipeline's tf-idf: ``idf = log(N / df)``, over the corpus the loader serves."""
    df = (bows > 0).sum(0).float()
    idf = torch.log(bows.shape[0] / df)
    tf = bows / bows.sum(1, keepdim=True).clamp_min(1)
    return tf * idf
