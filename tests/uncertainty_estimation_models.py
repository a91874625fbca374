"""Uncertainty estimation and calibration written as its papers' code writes it, for
``test_uncertainty_estimation``.

- ``EvidentialNet``: Sensoy et al.'s evidential classifier: an MLP whose evidence is
  ``relu``/``softplus``/``exp`` of its logits, ``alpha = evidence + 1``; the loss is the
  digamma (expected cross-entropy) form with the KL to the uniform Dirichlet (lgamma,
  digamma) annealed by ``min(1, epoch / 10)``, plus a belief-mass regulariser.
- ``HeteroscedasticMLP``: one member of a deep ensemble (Lakshminarayanan et al.): a mean and a
  log-variance head, the Gaussian NLL written by hand (``gaussian_nll``) or
  ``nn.GaussianNLLLoss`` on a softplus variance (``make_ensemble_member``).
- ``MCDropoutNet``: an MC-dropout classifier trained with Pereyra et al.'s confidence penalty
  (cross-entropy minus the predictive entropy, ``p * log p``), and BALD's mutual information
  of its ``T`` stochastic passes.
- ``FocalNet``: a classifier under Lin et al.'s focal loss ``-(1 - p)^gamma log p``.
- ``SNGP``: Liu et al.'s spectral-normalised residual MLP with a random-Fourier-feature GP head
  whose precision matrix is updated from each batch and factorised by Cholesky for the
  mean-field logits.
- ``TemperatureScaler``: Guo et al.'s temperature scaling, fitted with LBFGS on held-out logits.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

K = 4  # classes
D_IN = 8


def mlp(d_in: int, d_out: int, hidden: int = 32, p: float = 0.0) -> nn.Sequential:
    layers = [nn.Linear(d_in, hidden), nn.ReLU()]
    if p:
        layers.append(nn.Dropout(p))
    return nn.Sequential(*layers, nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, d_out))


def class_batch(g: torch.Generator, bad: int | None = None, n: int = 16, scale: float = 1.0):
    """Four Gaussian blobs in 8 dimensions; ``bad``: a record whose features are ``scale``
    times too large (a unit mismatch in one sensor's export)."""
    y = torch.randint(0, K, (n,), generator=g)
    centres = torch.eye(K, D_IN) * 3
    x = centres[y] + torch.randn(n, D_IN, generator=g)
    if bad is not None:
        x[bad] = x[bad] * scale
    return x, y


# ---------------------------------------------------------------------------------------------
# evidential deep learning


class EvidentialNet(nn.Module):
    def __init__(self, evidence: str = "softplus"):
        super().__init__()
        self.body = mlp(D_IN, K)
        self.evidence = evidence

    def forward(self, x):
        logits = self.body(x)
        if self.evidence == "relu":
            evidence = F.relu(logits)
        elif self.evidence == "exp":
            evidence = torch.exp(logits)  # the bug: no clamp(-10, 10) on the logits
        else:
            evidence = F.softplus(logits)
        return evidence + 1  # alpha


def kl_to_uniform(alpha):
    """KL(Dir(alpha) || Dir(1)) (Sensoy et al., eq. 5)."""
    ones = torch.ones_like(alpha)
    S = alpha.sum(1, keepdim=True)
    first = torch.lgamma(S) - torch.lgamma(alpha).sum(1, keepdim=True) - torch.lgamma(
        ones.sum(1, keepdim=True))
    second = ((alpha - ones) * (torch.digamma(alpha) - torch.digamma(S))).sum(1, keepdim=True)
    return first + second


class EDLLoss(nn.Module):
    """The digamma loss, the annealed KL of the misleading evidence, and a Brier term on the
    belief masses ``b_k = e_k / sum(e)``; ``epoch`` is set by the loop for the annealing."""

    def __init__(self, belief_weight: float = 0.1):
        super().__init__()
        self.epoch, self.belief_weight = 0, belief_weight

    def forward(self, alpha, y):
        onehot = F.one_hot(y, K).to(alpha.dtype)
        S = alpha.sum(1, keepdim=True)
        nll = (onehot * (torch.digamma(S) - torch.digamma(alpha))).sum(1)
        anneal = min(1.0, self.epoch / 10)
        alpha_tilde = onehot + (1 - onehot) * alpha
        kl = kl_to_uniform(alpha_tilde).squeeze(1)
        evidence = alpha - 1
        belief = evidence / (S - K)  # the bug: total evidence S - K is 0 when relu kills all
        brier = ((belief - onehot) ** 2).sum(1)
        return (nll + anneal * kl + self.belief_weight * brier).mean()


def make_edl_relu() -> EvidentialNet:
    torch.manual_seed(0)
    return EvidentialNet("relu")


def make_edl_softplus() -> EvidentialNet:
    torch.manual_seed(0)
    return EvidentialNet("softplus")


def make_edl_exp() -> EvidentialNet:
    torch.manual_seed(0)
    return EvidentialNet("exp")


# ---------------------------------------------------------------------------------------------
# heteroscedastic regression, deep ensembles


class HeteroscedasticMLP(nn.Module):
    def __init__(self, var: str = "log"):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(D_IN, 32), nn.SiLU(), nn.Linear(32, 32), nn.SiLU())
        self.mean, self.log_var = nn.Linear(32, 1), nn.Linear(32, 1)
        self.var = var

    def forward(self, x):
        h = self.body(x)
        mu, s = self.mean(h).squeeze(1), self.log_var(h).squeeze(1)
        if self.var == "softplus":
            return mu, F.softplus(s) + 1e-6
        if self.var == "exp":
            return mu, torch.exp(s)  # the head's variance, positive by construction
        return mu, s


def gaussian_nll(mu, log_var, y):
    """The hand-written NLL of a predicted log-variance."""
    var = log_var.exp()
    return (0.5 * torch.log(var) + (y - mu) ** 2 / (2 * var)).mean()  # the bug: log of exp


class EnsembleNLL(nn.GaussianNLLLoss):
    """``nn.GaussianNLLLoss`` (its eps clamp on the variance) given the head's (mean, var)."""

    def forward(self, mu, var, y):
        return super().forward(mu, y, var)


def make_hetero() -> HeteroscedasticMLP:
    torch.manual_seed(0)
    return HeteroscedasticMLP()


def make_ensemble_member() -> HeteroscedasticMLP:
    torch.manual_seed(0)
    return HeteroscedasticMLP(var="softplus")


def make_exp_var() -> HeteroscedasticMLP:
    torch.manual_seed(0)
    return HeteroscedasticMLP(var="exp")


def variance_nll(mu, var, y):
    """The Gaussian NLL of a predicted variance."""
    return (0.5 * torch.log(var) + (y - mu) ** 2 / (2 * var)).mean()  # log of the head's exp


def regression_batch(g: torch.Generator, bad: int | None = None, n: int = 16,
                     scale: float = 1.0):
    """y = sin of a projection plus noise that grows with |x_0|; ``bad``: a record whose
    features are ``scale`` times too large."""
    x = torch.randn(n, D_IN, generator=g)
    y = torch.sin(x[:, :2].sum(1)) + 0.1 * (1 + x[:, 0].abs()) * torch.randn(n, generator=g)
    if bad is not None:
        x[bad] = x[bad] * scale
    return x, y


class JointEnsemble(nn.Module):
    """Members trained jointly on the ensemble's moment-matched Gaussian; each mean head's
    bias starts at the targets' mean (house prices in their own units, not standardised)."""

    def __init__(self, members: int = 4, offset: float = 0.0):
        super().__init__()
        self.members = nn.ModuleList(HeteroscedasticMLP(var="softplus") for _ in range(members))
        for m in self.members:
            nn.init.constant_(m.mean.bias, offset)

    def forward(self, x):
        mus, variances = zip(*(m(x) for m in self.members))
        return torch.stack(mus), torch.stack(variances)


def mixture_nll(mus, variances, y):
    """The NLL of the mixture's moment-matched Gaussian: var = E[var + mu^2] - E[mu]^2."""
    mu = mus.mean(0)
    var = (variances + mus ** 2).mean(0) - mu ** 2  # the bug: E[x^2] - E[x]^2 at x ~ 1e4
    return (0.5 * torch.log(var) + (y - mu) ** 2 / (2 * var)).mean()  # of the mixture


def make_joint_ensemble() -> JointEnsemble:
    torch.manual_seed(0)
    return JointEnsemble(offset=2.5e5)


def price_batch(g: torch.Generator, bad: int | None = None, n: int = 16, scale: float = 1.0):
    """Prices around 250k in their own units."""
    x, y = regression_batch(g, bad, n, scale)
    return x, 2.5e5 + 1e3 * y


class DeepEvidentialRegression(nn.Module):
    """Amini et al.'s Normal-Inverse-Gamma head: (gamma, nu, alpha, beta), with nu and beta
    made positive by relu (as several ports write it) and alpha = softplus + 1."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(D_IN, 32), nn.SiLU(), nn.Linear(32, 32), nn.SiLU())
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        gamma, nu, alpha, beta = self.head(self.body(x)).float().unbind(-1)
        return gamma, F.relu(nu), F.softplus(alpha) + 1, F.relu(beta) + 1e-6


def nig_nll(gamma, nu, alpha, beta, y, coeff: float = 0.01):
    """The NIG negative log-likelihood and the evidence regulariser |y - gamma| (2 nu + alpha)."""
    omega = 2 * beta * (1 + nu)
    nll = (0.5 * torch.log(math.pi / nu) - alpha * torch.log(omega)  # the bug: nu = relu(.) = 0
           + (alpha + 0.5) * torch.log(nu * (y - gamma) ** 2 + omega)
           + torch.lgamma(alpha) - torch.lgamma(alpha + 0.5))
    return (nll + coeff * (y - gamma).abs() * (2 * nu + alpha)).mean()


def make_der() -> DeepEvidentialRegression:
    torch.manual_seed(0)
    return DeepEvidentialRegression()


# ---------------------------------------------------------------------------------------------
# MC dropout, confidence penalty, BALD


class MCDropoutNet(nn.Module):
    def __init__(self, p: float = 0.2):
        super().__init__()
        self.body = mlp(D_IN, K, p=p)

    def forward(self, x):
        return self.body(x)


def entropy(p):
    return -(p * torch.log(p)).sum(-1)  # the bug: 0 * log 0 where a probability underflowed


class ConfidencePenalty(nn.Module):
    """Cross-entropy minus beta times the predictive entropy (Pereyra et al. 2017)."""

    def __init__(self, beta: float = 0.1):
        super().__init__()
        self.beta = beta

    def forward(self, logits, y):
        p = logits.softmax(-1)
        return F.cross_entropy(logits, y) - self.beta * entropy(p).mean()


def bald(model: nn.Module, x, T: int = 8):
    """BALD's mutual information: the entropy of the mean of T dropout passes minus the mean
    of their entropies (dropout stays on)."""
    probs = torch.stack([model(x).softmax(-1) for _ in range(T)])
    return entropy(probs.mean(0)) - entropy(probs).mean(0)


def make_mc_dropout() -> MCDropoutNet:
    torch.manual_seed(0)
    return MCDropoutNet()


# ---------------------------------------------------------------------------------------------
# focal loss


class FocalLoss(nn.Module):
    def __init__(self, gamma: float = 2.0):
        super().__init__()
        self.gamma = gamma

    def forward(self, logits, y):
        logp = F.log_softmax(logits, -1).gather(1, y[:, None]).squeeze(1)
        p = logp.exp()
        return (-(1 - p) ** self.gamma * logp).mean()  # gamma < 1: d/dp (1-p)^g at p = 1


def make_focal() -> MCDropoutNet:
    torch.manual_seed(0)
    return MCDropoutNet(p=0.0)


# ---------------------------------------------------------------------------------------------
# SNGP


class SNGP(nn.Module):
    """Spectral-normalised residual MLP, random Fourier features, a GP output layer whose
    precision ``ridge I + sum_batches phi^T phi`` (momentum-averaged) is kept as a buffer."""

    def __init__(self, hidden: int = 32, n_rff: int = 64, ridge: float = 1.0,
                 momentum: float = 0.9, use_inv: bool = False):
        super().__init__()
        sn = nn.utils.parametrizations.spectral_norm
        self.inp = nn.Linear(D_IN, hidden)
        self.blocks = nn.ModuleList([sn(nn.Linear(hidden, hidden)) for _ in range(2)])
        self.register_buffer("rff_w", torch.randn(hidden, n_rff))
        self.register_buffer("rff_b", torch.rand(n_rff) * 2 * math.pi)
        self.beta = nn.Linear(n_rff, K, bias=False)
        self.register_buffer("precision", ridge * torch.eye(n_rff))
        self.ridge, self.momentum, self.n_rff, self.use_inv = ridge, momentum, n_rff, use_inv

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + F.relu(block(h))
        phi = math.sqrt(2.0 / self.n_rff) * torch.cos(h @ self.rff_w + self.rff_b)
        logits = self.beta(phi)
        if self.training:
            with torch.no_grad():
                batch_prec = phi.T @ phi
                self.precision.mul_(self.momentum).add_((1 - self.momentum) * batch_prec)
        # mean-field logits: var_i = phi_i^T Sigma phi_i with Sigma = precision^-1
        if self.use_inv:  # the covariance itself, as the SNGP reference's eval step keeps it
            cov = torch.linalg.inv(self.precision)
            var = ((phi.detach() @ cov) * phi.detach()).sum(1)
        else:
            L = torch.linalg.cholesky(self.precision)
            v = torch.linalg.solve_triangular(L, phi.T.detach(), upper=False)
            var = (v ** 2).sum(0)
        return logits / torch.sqrt(1 + math.pi / 8 * var)[:, None]


def make_sngp() -> SNGP:
    torch.manual_seed(0)
    return SNGP()


def make_sngp_no_ridge() -> SNGP:
    torch.manual_seed(0)
    return SNGP(ridge=0.0)  # the bug: precision starts at 0 I, batch 16 < 64 features


def make_sngp_inv_no_ridge() -> SNGP:
    torch.manual_seed(0)
    return SNGP(ridge=0.0, use_inv=True)


# ---------------------------------------------------------------------------------------------
# temperature scaling


class TemperatureScaler(nn.Module):
    def __init__(self):
        super().__init__()
        self.temperature = nn.Parameter(torch.ones(1) * 1.5)

    def forward(self, logits):
        return logits / self.temperature


def make_temperature() -> TemperatureScaler:
    return TemperatureScaler()


# ---------------------------------------------------------------------------------------------
# classes unavailable per record (a label space that varies by site), masked with -inf


class MaskedMCDropout(MCDropoutNet):
    """MC dropout whose logits of the classes a record cannot take are -inf."""

    def forward(self, x, available):
        return self.body(x).masked_fill(~available, float("-inf"))


def make_masked_mc_dropout() -> MaskedMCDropout:
    torch.manual_seed(0)
    return MaskedMCDropout()


def masked_batch(g: torch.Generator, n: int = 16):
    """Records with their available classes (the label's always among them)."""
    x, y = class_batch(g, n=n)
    available = torch.rand(n, K, generator=g) < 0.6
    available[torch.arange(n), y] = True
    return x, available, y
