"""Deep clustering and neural topic models written the way their public repositories write them;
the factories of ``test_deep_clustering.py``.

- ``IDEC``: XifengGuo/IDEC-pytorch (``idec.py``) and vlukiyanov/pt-dec (``cluster.py``): an
  autoencoder whose embedding meets a ``cluster_layer`` of centres through the Student-t kernel
  ``q = (1 + |z - mu|^2 / alpha) ^ -((alpha + 1) / 2)``, rows normalised; the target
  ``p = q^2 / f`` with cluster frequency ``f = q.sum(0)``, and ``KL(p || q)`` through
  ``F.kl_div(q.log(), p)``. Centres come from a k-means on the embeddings written the way
  subhadarship/kmeans_pytorch writes it (``X[choice == k].mean(0)``). ``euclidean`` keeps the
  distances as ``torch.sqrt`` of the summed squares (squared again for the kernel), as code
  sharing a distance helper with a DCN-style k-means loss does.
- ``SoftKMeansAssignment``: MaziarMF/deep-k-means (DKM): ``softmax(-alpha * |z - mu|^2)``
  with ``alpha`` annealed, trained here with DEC's target as pt-dec's loop does (``dec.py``:
  ``loss_function(output.log(), target)``, the log taken by the loop).
- ``DeepClusterHead``: facebookresearch/swav ``main_deepclusterv2.py``: prototypes (a bias-free
  ``nn.Linear``) reset to the k-means centroids ``emb_sums / counts`` each epoch (an empty
  cluster keeps its old one: ``mask = counts > 0``), pseudo-labels the cross-entropy of
  ``prototypes(normalize(z)) / temperature`` is trained on, optionally class-balanced.
- ``ProdLDA``: hyqneuron/pytorch-avitm (``pytorch_model.py``) and pyro's ProdLDA example: the
  encoder gives the mean and log-variance of a logistic normal whose prior is the Laplace
  approximation of a Dirichlet(``alpha``), ``theta = softmax(mu + sigma * eps)``, the
  product-of-experts decoder ``softmax(bn(beta(theta)))``, the reconstruction
  ``-(bow * log(recon + 1e-10)).sum(1)``.
- ``DirichletVAE``: the Dirichlet-VAE topic models (Burkhardt & Kramer's DVAE, the Dirichlet
  variant of pyro's ProdLDA): the encoder's concentration ``softplus(fc(h))``, ``theta``
  from ``Dirichlet(alpha, validate_args=False).rsample()`` (Gamma rsample), the KL to the
  prior by ``torch.distributions.kl_divergence`` (lgamma and digamma).
- ``ETM``: adjidieng/ETM (``etm.py``/``main.py``): each bag of words normalised by its length
  (``bows / sums``, ``bow_norm``) for the encoder, by the loop or in ``forward`` (which also
  takes the bags as sparse rows), the KL of a Gaussian in ``logsigma.exp()``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import Dirichlet, kl_divergence

FEATURES, EMBED, CLUSTERS, BATCH = 12, 4, 3, 8
VOCAB, TOPICS, HIDDEN = 30, 4, 16


# --------------------------------------------------------------------------------------------
# DEC / IDEC


class AE(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc_1 = nn.Linear(FEATURES, 16)
        self.z_layer = nn.Linear(16, EMBED)
        self.dec_1 = nn.Linear(EMBED, 16)
        self.x_bar_layer = nn.Linear(16, FEATURES)

    def forward(self, x):
        z = self.z_layer(F.relu(self.enc_1(x)))
        return self.x_bar_layer(F.relu(self.dec_1(z))), z


class ClusterAssignment(nn.Module):
    """pt-dec's soft assignment: the Student-t kernel with ``alpha`` degrees of freedom."""

    def __init__(self, alpha: float, euclidean: bool = False):
        super().__init__()
        self.alpha = alpha
        self.euclidean = euclidean
        self.cluster_centers = nn.Parameter(torch.randn(CLUSTERS, EMBED))

    def forward(self, z):
        norm_squared = torch.sum((z.unsqueeze(1) - self.cluster_centers) ** 2, 2)
        if self.euclidean:  # distances first, as DCN-style code keeps them, then squared
            norm_squared = torch.sqrt(norm_squared) ** 2
        numerator = 1.0 / (1.0 + (norm_squared / self.alpha))
        power = float(self.alpha + 1) / 2
        numerator = numerator ** power
        return numerator / torch.sum(numerator, dim=1, keepdim=True)


class SoftKMeansAssignment(nn.Module):
    """MaziarMF/deep-k-means' soft assignment: ``softmax(-alpha * |z - mu|^2)``, with
    ``alpha`` annealed upward by the loop until the assignment is all but hard."""

    def __init__(self):
        super().__init__()
        self.alpha = 1.0
        self.cluster_centers = nn.Parameter(torch.randn(CLUSTERS, EMBED))

    def forward(self, z):
        dist = torch.sum((z.unsqueeze(1) - self.cluster_centers) ** 2, 2)
        return F.softmax(-self.alpha * dist, dim=1)


class IDEC(nn.Module):
    def __init__(self, alpha: float = 1.0, euclidean: bool = False, soft_kmeans: bool = False):
        super().__init__()
        self.ae = AE()
        self.assignment = SoftKMeansAssignment() if soft_kmeans else \
            ClusterAssignment(alpha, euclidean)

    def forward(self, x):
        x_bar, z = self.ae(x)
        return x_bar, self.assignment(z)


def target_distribution(q):
    weight = q ** 2 / q.sum(0)
    return (weight.t() / weight.sum(1)).t()


def idec_loss(x_bar, q, x, p, gamma: float = 0.1):
    kl_loss = F.kl_div(q.log(), p, reduction="batchmean")
    return gamma * kl_loss + F.mse_loss(x_bar, x)


def kmeans(X, num_clusters: int, iters: int = 5):
    """kmeans_pytorch's loop: centres are the mean of the points each one was chosen by."""
    state = X[:num_clusters].clone()
    for _ in range(iters):
        choice = torch.cdist(X, state).argmin(dim=1)
        for index in range(num_clusters):
            state[index] = X[choice == index].mean(dim=0)
    return state


def make_idec():
    torch.manual_seed(0)
    return IDEC()


def make_dkm():
    torch.manual_seed(0)
    return IDEC(soft_kmeans=True)


def make_idec_euclidean():
    torch.manual_seed(0)
    return IDEC(euclidean=True)


# --------------------------------------------------------------------------------------------
# DeepCluster-v2


class DeepClusterHead(nn.Module):
    def __init__(self, temperature: float = 0.1):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Linear(16, EMBED))
        self.prototypes = nn.Linear(EMBED, CLUSTERS, bias=False)
        self.temperature = temperature

    def forward(self, x):
        z = F.normalize(self.backbone(x), dim=1, p=2)
        return self.prototypes(z) / self.temperature


def deepcluster_centroids(emb, assignments, old, guard: bool = True):
    """swav's centroid update: an empty cluster keeps its old centroid (``mask = counts >
    0``); without ``guard``, ``emb_sums / counts`` is 0/0 there."""
    k = old.shape[0]
    emb_sums = torch.zeros(k, emb.shape[1]).index_add_(0, assignments, emb)
    counts = torch.bincount(assignments, minlength=k)
    if not guard:
        return F.normalize(emb_sums / counts.unsqueeze(1), dim=1)
    mask = counts > 0
    centroids = old.clone()
    centroids[mask] = emb_sums[mask] / counts[mask].unsqueeze(1)
    return F.normalize(centroids, dim=1)


def balanced_ce(logits, pseudo_labels, weight):
    """The pseudo-labels' cross-entropy, each cluster weighted by its inverse size."""
    return F.cross_entropy(logits, pseudo_labels, weight=weight)


def make_deepcluster():
    torch.manual_seed(0)
    return DeepClusterHead()


# --------------------------------------------------------------------------------------------
# ProdLDA (AVITM)


class ProdLDA(nn.Module):
    def __init__(self, alpha: float = 1.0):
        super().__init__()
        self.en1_fc = nn.Linear(VOCAB, HIDDEN)
        self.en2_fc = nn.Linear(HIDDEN, HIDDEN)
        self.en2_drop = nn.Dropout(0.2)
        self.mean_fc = nn.Linear(HIDDEN, TOPICS)
        self.mean_bn = nn.BatchNorm1d(TOPICS)
        self.logvar_fc = nn.Linear(HIDDEN, TOPICS)
        self.logvar_bn = nn.BatchNorm1d(TOPICS)
        self.p_drop = nn.Dropout(0.2)
        self.decoder = nn.Linear(TOPICS, VOCAB)
        self.decoder_bn = nn.BatchNorm1d(VOCAB)
        # the Laplace approximation of a symmetric Dirichlet(alpha) prior
        a = torch.full((1, TOPICS), alpha)
        prior_mean = (a.log().t() - a.log().mean(1)).t()
        prior_var = ((1.0 / a) * (1 - 2.0 / TOPICS)).t() + (1.0 / (TOPICS ** 2)) * (1.0 / a).sum(1)
        self.register_buffer("prior_mean", prior_mean)
        self.register_buffer("prior_var", prior_var.t())
        self.register_buffer("prior_logvar", prior_var.t().log())

    def forward(self, bow):
        en1 = F.softplus(self.en1_fc(bow))
        en2 = self.en2_drop(F.softplus(self.en2_fc(en1)))
        mean = self.mean_bn(self.mean_fc(en2))
        logvar = self.logvar_bn(self.logvar_fc(en2))
        eps = torch.randn_like(mean)
        z = mean + logvar.exp().sqrt() * eps
        p = self.p_drop(F.softmax(z, dim=1))
        recon = F.softmax(self.decoder_bn(self.decoder(p)), dim=1)
        return recon, mean, logvar

    def loss(self, recon, mean, logvar, bow):
        nl = -(bow * (recon + 1e-10).log()).sum(1)
        var = logvar.exp()
        var_division = var / self.prior_var
        diff = mean - self.prior_mean
        diff_term = diff * diff / self.prior_var
        logvar_division = self.prior_logvar - logvar
        kld = 0.5 * ((var_division + diff_term + logvar_division).sum(1) - TOPICS)
        return (nl + kld).mean()


def make_prodlda():
    torch.manual_seed(0)
    return ProdLDA()


# --------------------------------------------------------------------------------------------
# Dirichlet VAE


class DirichletVAE(nn.Module):
    def __init__(self, prior_alpha: float = 0.02):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(VOCAB, HIDDEN), nn.Softplus())
        self.alpha_fc = nn.Linear(HIDDEN, TOPICS)
        self.beta = nn.Linear(TOPICS, VOCAB, bias=False)
        self.register_buffer("prior_alpha", torch.full((TOPICS,), prior_alpha))

    def forward(self, bow):
        alpha = F.softplus(self.alpha_fc(self.encoder(bow)))
        posterior = Dirichlet(alpha, validate_args=False)  # (checks off, for speed)
        theta = posterior.rsample()
        log_recon = F.log_softmax(self.beta(theta), dim=1)
        kl = kl_divergence(posterior, Dirichlet(self.prior_alpha))
        return log_recon, kl


def dvae_loss(log_recon, kl, bow):
    return (-(bow * log_recon).sum(1) + kl).mean()


def make_dvae():
    torch.manual_seed(0)
    return DirichletVAE()


# --------------------------------------------------------------------------------------------
# ETM


class ETM(nn.Module):
    def __init__(self, rho_size: int = 8):
        super().__init__()
        self.rho = nn.Linear(rho_size, VOCAB, bias=False)
        self.alphas = nn.Linear(rho_size, TOPICS, bias=False)
        self.q_theta = nn.Sequential(nn.Linear(VOCAB, HIDDEN), nn.ReLU(),
                                     nn.Linear(HIDDEN, HIDDEN), nn.ReLU())
        self.mu_q_theta = nn.Linear(HIDDEN, TOPICS)
        self.logsigma_q_theta = nn.Linear(HIDDEN, TOPICS)

    def encode(self, bows):
        q_theta = self.q_theta(bows)
        mu_theta = self.mu_q_theta(q_theta)
        logsigma_theta = self.logsigma_q_theta(q_theta)
        kl_theta = -0.5 * torch.sum(
            1 + logsigma_theta - mu_theta.pow(2) - logsigma_theta.exp(), dim=-1).mean()
        std = torch.exp(0.5 * logsigma_theta)
        z = torch.randn_like(std).mul_(std).add_(mu_theta) if self.training else mu_theta
        return F.softmax(z, dim=-1), kl_theta

    def forward(self, bows, normalized_bows=None):
        if bows.is_sparse:  # (a large vocabulary's bags of words, collated as sparse rows)
            bows = bows.to_dense()
        if normalized_bows is None:  # main.py's bow_norm, done in the model
            normalized_bows = bows / bows.sum(1, keepdim=True)
        theta, kld_theta = self.encode(normalized_bows)
        beta = F.softmax(self.alphas(self.rho.weight), dim=0).transpose(1, 0)
        preds = torch.log(torch.mm(theta, beta) + 1e-6)
        recon_loss = -(preds * bows).sum(1)
        return recon_loss.mean(), kld_theta


def make_etm():
    torch.manual_seed(0)
    return ETM()


def corpus(g, n: int, empty=()):
    """``n`` bags of words (Poisson counts over a few topics), the rows in ``empty`` blank."""
    topics = torch.softmax(torch.randn(TOPICS, VOCAB, generator=g) * 2, dim=1)
    mix = torch.distributions.Dirichlet(torch.full((TOPICS,), 0.5)).sample((n,))
    rate = 20 * mix @ topics
    bows = torch.poisson(rate, generator=g)
    bows[list(empty)] = 0
    return bows


def blobs(g, n: int, scale: float = 1.0):
    """``n`` points around ``CLUSTERS`` centres in ``FEATURES`` dims."""
    centres = torch.randn(CLUSTERS, FEATURES, generator=g) * 3
    labels = torch.arange(n) % CLUSTERS
    return (centres[labels] + torch.randn(n, FEATURES, generator=g)) * scale, labels
