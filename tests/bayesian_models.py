"""Bayesian deep learning and probabilistic regression as the well-known repositories write it,
for ``test_bayesian``: a mixture density network with Bishop's density-domain loss, evidential
regression's Normal-Inverse-Gamma head (Amini et al.), evidential classification's Dirichlet
(Sensoy et al.), and Bayes-by-backprop layers with Blundell's scale-mixture prior, their
log prior and posterior kept aside by the layers and added to the loss by the loop."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class MDN(nn.Module):
    """Bishop's mixture density network: mixing weights by softmax, means, widths by exp."""

    def __init__(self, k: int = 3, hidden: int = 16):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(1, hidden), nn.Tanh(), nn.Linear(hidden, hidden),
                                  nn.Tanh())
        self.pi = nn.Linear(hidden, k)
        self.mu = nn.Linear(hidden, k)
        self.sigma = nn.Linear(hidden, k)

    def forward(self, x):
        h = self.body(x)
        return torch.softmax(self.pi(h), -1), self.mu(h), torch.exp(self.sigma(h))


def make_mdn():
    torch.manual_seed(0)
    return MDN()


def mdn_loss(out, y):
    """The density-domain loss many MDN tutorials write: the mixture's density, then its log
    (the bug: a target far from every component makes every density 0, and log(0) = -inf;
    ``logsumexp(log_softmax(pi) + Normal(mu, sigma).log_prob(y))`` is the stable form)."""
    pi, mu, sigma = out
    density = torch.exp(-0.5 * ((y - mu) / sigma) ** 2) / (sigma * math.sqrt(2 * math.pi))
    return -torch.log((pi * density).sum(-1)).mean()


class EvidentialRegressor(nn.Module):
    """Deep evidential regression: a Normal-Inverse-Gamma head (gamma, nu, alpha, beta),
    positivity by softplus, as the paper's ``DenseNormalGamma`` layer."""

    def __init__(self, d_in: int = 4, hidden: int = 16):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                                  nn.ReLU())
        self.head = nn.Linear(hidden, 4)

    def forward(self, x):
        gamma, lognu, logalpha, logbeta = self.head(self.body(x)).unbind(-1)
        nu, beta = F.softplus(lognu), F.softplus(logbeta)
        alpha = F.softplus(logalpha) + 1.0
        return gamma, nu, alpha, beta


def make_evidential():
    torch.manual_seed(0)
    return EvidentialRegressor()


def nig_nll(out, y, coeff: float = 1e-2):
    """The NIG negative log-likelihood plus the evidence regulariser, as in the paper's code:
    ``0.5 * log(pi / nu)`` (the bug: no eps under nu, whose softplus can round to 0)."""
    gamma, nu, alpha, beta = out
    omega = 2 * beta * (1 + nu)
    nll = (0.5 * torch.log(math.pi / nu) - alpha * torch.log(omega)
           + (alpha + 0.5) * torch.log(nu * (y - gamma) ** 2 + omega)
           + torch.lgamma(alpha) - torch.lgamma(alpha + 0.5))
    reg = (y - gamma).abs() * (2 * nu + alpha)
    return (nll + coeff * reg).mean()


class EvidentialClassifier(nn.Module):
    """Evidential deep learning for classification: Dirichlet concentrations
    ``alpha = evidence + 1`` with ``evidence = exp(logits)`` (the variant without clamping)."""

    def __init__(self, d_in: int = 4, k: int = 3, hidden: int = 16, relu: bool = False):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, k))
        self.relu = relu  # evidence by relu, and the bug of taking it for alpha (no + 1)

    def forward(self, x):
        return F.relu(self.body(x)) if self.relu else torch.exp(self.body(x)) + 1.0


def make_edl(**kw):
    torch.manual_seed(0)
    return EvidentialClassifier(**kw)


def edl_digamma_loss(alpha, y, kl_weight: float = 0.1):
    """Sensoy's expected cross-entropy under the Dirichlet plus the annealed KL to Dir(1)."""
    onehot = F.one_hot(y, alpha.shape[-1]).float()
    s = alpha.sum(-1, keepdim=True)
    ce = (onehot * (torch.digamma(s) - torch.digamma(alpha))).sum(-1)
    a = onehot + (1 - onehot) * alpha
    sa = a.sum(-1, keepdim=True)
    kl = (torch.lgamma(sa).squeeze(-1) - math.lgamma(alpha.shape[-1])
          - torch.lgamma(a).sum(-1)
          + ((a - 1) * (torch.digamma(a) - torch.digamma(sa))).sum(-1))
    return (ce + kl_weight * kl).mean()


class BayesLinear(nn.Module):
    """Bayes by backprop: a Gaussian posterior per weight, ``sigma = log1p(exp(rho))``, one
    reparameterised sample per forward; the forward keeps its ``log_prior`` (Blundell's scale
    mixture, written with densities) and ``log_posterior`` aside for the loop's ELBO."""

    def __init__(self, d_in, d_out, pi=0.5, neg_log_sigma1=2.0, neg_log_sigma2=6.0,
                 rho0=-3.0):
        super().__init__()
        self.w_mu = nn.Parameter(torch.empty(d_out, d_in).uniform_(-0.2, 0.2))
        self.w_rho = nn.Parameter(torch.full((d_out, d_in), rho0))
        self.b_mu = nn.Parameter(torch.zeros(d_out))
        self.b_rho = nn.Parameter(torch.full((d_out,), rho0))
        self.pi = pi
        self.sigma1, self.sigma2 = math.exp(-neg_log_sigma1), math.exp(-neg_log_sigma2)
        self.log_prior = self.log_posterior = torch.zeros(())

    def _gauss(self, x, sigma):
        return torch.exp(-0.5 * (x / sigma) ** 2) / (sigma * math.sqrt(2 * math.pi))

    def _prior(self, w):
        return torch.log(self.pi * self._gauss(w, self.sigma1)
                         + (1 - self.pi) * self._gauss(w, self.sigma2)).sum()

    def forward(self, x):
        w_sigma = torch.log1p(torch.exp(self.w_rho))
        b_sigma = torch.log1p(torch.exp(self.b_rho))
        w = self.w_mu + w_sigma * torch.randn_like(w_sigma)
        b = self.b_mu + b_sigma * torch.randn_like(b_sigma)
        self.log_prior = self._prior(w) + self._prior(b)
        self.log_posterior = (torch.distributions.Normal(self.w_mu, w_sigma).log_prob(w).sum()
                              + torch.distributions.Normal(self.b_mu, b_sigma).log_prob(b).sum())
        return F.linear(x, w, b)


class BayesMLP(nn.Module):
    def __init__(self, d_in=4, hidden=16, **kw):
        super().__init__()
        self.l1 = BayesLinear(d_in, hidden, **kw)
        self.l2 = BayesLinear(hidden, 1, **kw)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x))).squeeze(-1)

    def kl(self):
        return sum(m.log_posterior - m.log_prior for m in (self.l1, self.l2))


def make_bayes_mlp(**kw):
    torch.manual_seed(0)
    return BayesMLP(**kw)


class LocalReparamLinear(nn.Module):
    """Bayes by backprop with the local reparameterisation trick (Kingma et al. 2015): the
    pre-activations are sampled, ``mean = x @ mu.T``, ``std = sqrt(x**2 @ sigma**2.T)``
    (the bug: no eps inside the sqrt, whose derivative is infinite where a row of ``x`` is all
    zeros), and the closed-form KL to N(0, prior_sigma**2) is kept aside."""

    def __init__(self, d_in, d_out, prior_sigma=1.0, log_sigma0=-4.0):
        super().__init__()
        self.mu = nn.Parameter(torch.randn(d_out, d_in) / math.sqrt(d_in))
        self.log_sigma = nn.Parameter(torch.full((d_out, d_in), log_sigma0))
        self.bias = nn.Parameter(torch.zeros(d_out))
        self.prior_sigma = prior_sigma

    def forward(self, x):
        sigma = torch.exp(self.log_sigma)
        mean = F.linear(x, self.mu, self.bias)
        std = torch.sqrt(F.linear(x ** 2, sigma ** 2))
        self.kl = (torch.log(self.prior_sigma / sigma)
                   + (sigma ** 2 + self.mu ** 2) / (2 * self.prior_sigma ** 2) - 0.5).sum()
        return mean + std * torch.randn_like(std)


class LocalReparamMLP(nn.Module):
    def __init__(self, d_in=4, hidden=16):
        super().__init__()
        self.l1 = LocalReparamLinear(d_in, hidden)
        self.l2 = LocalReparamLinear(hidden, 1)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x))).squeeze(-1)


def make_local_reparam():
    torch.manual_seed(0)
    return LocalReparamMLP()


class ExactGP(nn.Module):
    """Exact GP regression's kernel matrix over the batch: a Matern-5/2 kernel with learned
    lengthscale, outputscale and noise, each through softplus, with jitter on the diagonal;
    ``r`` written as the sqrt of the squared distances (the bug: its derivative is infinite
    on the diagonal, where r = 0; GPyTorch clamps the squared distance to 1e-30)."""

    def __init__(self, d_in: int = 2, clamp: float | None = None):
        super().__init__()
        self.raw_lengthscale = nn.Parameter(torch.zeros(d_in))
        self.raw_outputscale = nn.Parameter(torch.zeros(()))
        self.raw_noise = nn.Parameter(torch.tensor(-2.0))
        self.clamp = clamp

    def forward(self, x):
        z = x / F.softplus(self.raw_lengthscale)
        d2 = (z[:, None, :] - z[None, :, :]).pow(2).sum(-1)
        if self.clamp is not None:
            d2 = d2.clamp_min(self.clamp)
        r = math.sqrt(5) * torch.sqrt(d2)
        k = F.softplus(self.raw_outputscale) * (1 + r + r ** 2 / 3) * torch.exp(-r)
        noise = F.softplus(self.raw_noise) + 1e-4
        return k + noise * torch.eye(len(x))


def make_exact_gp(**kw):
    torch.manual_seed(0)
    return ExactGP(**kw)


def gp_neg_mll(k, y):
    """The negative log marginal likelihood by Cholesky, per data point."""
    chol = torch.linalg.cholesky(k)
    alpha = torch.cholesky_solve(y[:, None], chol).squeeze(-1)
    n = len(y)
    return (0.5 * y @ alpha + torch.log(torch.diagonal(chol)).sum()
            + 0.5 * n * math.log(2 * math.pi)) / n


class MixtureMDN(MDN):
    """The MDN written with ``torch.distributions``: the model returns the mixture itself,
    ``MixtureSameFamily(Categorical(logits), Normal(mu, sigma))``."""

    def forward(self, x):
        h = self.body(x)
        comp = torch.distributions.Normal(self.mu(h), torch.exp(self.sigma(h)))
        return torch.distributions.MixtureSameFamily(
            torch.distributions.Categorical(logits=self.pi(h)), comp)


def make_mixture_mdn():
    torch.manual_seed(0)
    return MixtureMDN()


def mixture_nll(dist, y):
    return -dist.log_prob(y.squeeze(-1)).mean()


class Heteroscedastic(nn.Module):
    """Kendall & Gal's heteroscedastic regression: a mean and a log-variance head."""

    def __init__(self, d_in: int = 4, hidden: int = 16):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU())
        self.mean = nn.Linear(hidden, 1)
        self.log_var = nn.Linear(hidden, 1)

    def forward(self, x):
        h = self.body(x)
        return self.mean(h).squeeze(-1), self.log_var(h).squeeze(-1)


def make_heteroscedastic():
    torch.manual_seed(0)
    return Heteroscedastic()


def gaussian_nll(out, y):
    mean, log_var = out
    return torch.nn.functional.gaussian_nll_loss(mean, y, torch.exp(log_var))


def hetero_loss(out, y):
    mean, log_var = out
    return (0.5 * torch.exp(-log_var) * (y - mean) ** 2 + 0.5 * log_var).mean()


class DirichletClassifier(EvidentialClassifier):
    """The evidential classifier returning ``Dirichlet(alpha)`` itself."""

    def forward(self, x):
        return torch.distributions.Dirichlet(torch.exp(self.body(x)) + 1.0)


def make_dirichlet():
    torch.manual_seed(0)
    return DirichletClassifier()


def dirichlet_loss(dist, y, kl_weight: float = 0.1):
    """The expected cross-entropy under the Dirichlet, plus the KL of its misleading evidence
    to the flat Dirichlet, through ``torch.distributions.kl_divergence``."""
    alpha = dist.concentration
    onehot = F.one_hot(y, alpha.shape[-1]).float()
    ce = (onehot * (torch.digamma(alpha.sum(-1, keepdim=True)) - torch.digamma(alpha))).sum(-1)
    flat = torch.distributions.Dirichlet(torch.ones_like(alpha))
    kl = torch.distributions.kl_divergence(
        torch.distributions.Dirichlet(onehot + (1 - onehot) * alpha), flat)
    return (ce + kl_weight * kl).mean()


class DirichletVAE(nn.Module):
    """A topic model with a Dirichlet latent (a Dirichlet VAE): the encoder's concentrations
    by softplus, one reparameterised ``rsample`` (implicit reparameterisation gradients),
    topics decoded by a softmax over the vocabulary."""

    def __init__(self, vocab: int = 20, topics: int = 4, hidden: int = 16):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(vocab, hidden), nn.Softplus(),
                                     nn.Linear(hidden, topics))
        self.topics = nn.Linear(topics, vocab, bias=False)

    def forward(self, bow):
        alpha = F.softplus(self.encoder(bow))
        z = torch.distributions.Dirichlet(alpha).rsample()
        return self.topics(z).log_softmax(-1), z, alpha


def make_dirichlet_vae():
    torch.manual_seed(0)
    return DirichletVAE()


def dirichlet_elbo(out, bow, prior: float = 0.3):
    """The bag-of-words reconstruction plus a one-sample Monte Carlo KL, ``log q(z) - log
    p(z)`` under a sparse Dirichlet prior."""
    log_probs, z, alpha = out
    q = torch.distributions.Dirichlet(alpha)
    p = torch.distributions.Dirichlet(torch.full_like(alpha, prior))
    return (-(bow * log_probs).sum(-1) + q.log_prob(z) - p.log_prob(z)).mean()


class GaussianMember(nn.Module):
    """One member of a deep ensemble (Lakshminarayanan et al.): a mean and a variance head,
    the variance through exp (the bug: unbounded; the paper's softplus + 1e-6 is the fix)."""

    def __init__(self, d_in: int = 4, hidden: int = 16):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, 2)

    def forward(self, x):
        mean, log_var = self.fc2(torch.relu(self.fc1(x))).unbind(-1)
        return torch.stack([mean, torch.exp(log_var)], -1)


class VmapEnsemble(nn.Module):
    """A deep ensemble as PyTorch's model-ensembling tutorial writes it: the members' weights
    stacked by ``torch.func.stack_module_state``, the members run at once by ``torch.vmap``
    over ``functional_call`` of one stateless copy; output (members, batch, 2)."""

    def __init__(self, members: int = 4):
        super().__init__()
        nets = [GaussianMember() for _ in range(members)]
        params, _ = torch.func.stack_module_state(nets)
        self.names = list(params)
        self.stacked = nn.ParameterList([nn.Parameter(params[n]) for n in self.names])
        self._base = [GaussianMember().to("meta")]  # (a list: not a submodule)

    def forward(self, x):
        def one(params, x):
            return torch.func.functional_call(self._base[0], dict(zip(self.names, params)),
                                              (x,))
        return torch.vmap(one, in_dims=(0, None))(tuple(self.stacked), x)


def make_vmap_ensemble():
    torch.manual_seed(0)
    return VmapEnsemble()


def ensemble_nll(out, y):
    """Each member's Gaussian NLL, summed over the members (each trained on its own NLL)."""
    mean, var = out.unbind(-1)
    return F.gaussian_nll_loss(mean, y.expand_as(mean), var, reduction="mean") * len(out)


class PSGLD(torch.optim.Optimizer):
    """Preconditioned stochastic gradient Langevin dynamics (Li et al. 2016): RMSprop's
    preconditioner ``G = 1 / (lam + sqrt(V))`` on the gradient step, plus Gaussian noise of
    variance ``lr * G``. ``lam`` is the paper's eps (1e-5); the bug is ``lam=0``: a weight
    whose gradient has always been exactly 0 (a dead unit) has ``V = 0`` and ``G = inf``."""

    def __init__(self, params, lr=1e-3, alpha=0.99, lam=1e-5, num_data=1):
        super().__init__(params, dict(lr=lr, alpha=alpha, lam=lam, num_data=num_data))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["V"] = torch.zeros_like(p)
                v = state["V"]
                v.mul_(group["alpha"]).addcmul_(p.grad, p.grad, value=1 - group["alpha"])
                g = 1.0 / (group["lam"] + v.sqrt())
                noise = torch.randn_like(p) * (group["lr"] * g).sqrt()
                p.add_(-0.5 * group["lr"] * g * p.grad * group["num_data"] + noise)


def make_sgld_mlp(lam: float = 1e-5):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    with torch.no_grad():
        model[0].bias[3] = -50.0  # a unit no input reaches: dead from the start
    return {"model": model,
            "optimizer": lambda groups: PSGLD(groups, lr=1e-4, lam=lam, num_data=64)}


def make_exact_gp64(**kw):
    return make_exact_gp(**kw).double()


class BetaRegressor(nn.Module):
    """Regression of a rate in (0, 1) by a Beta likelihood, or of an amount > 0 (rainfall, a
    claim) by a Gamma one: the two parameters by softplus, the model returning the
    distribution."""

    def __init__(self, d_in: int = 4, hidden: int = 16, family: str = "beta"):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, 2))
        self.family = family

    def forward(self, x):
        c = F.softplus(self.body(x)) + 1e-3
        cls = torch.distributions.Beta if self.family == "beta" else torch.distributions.Gamma
        return cls(c[:, 0], c[:, 1], validate_args=False)


def make_beta(**kw):
    torch.manual_seed(0)
    return BetaRegressor(**kw)


def beta_nll(dist, y):
    return -dist.log_prob(y).mean()


def rbf(a, b, lengthscale, outputscale):
    d2 = ((a[:, None, :] - b[None, :, :]) / lengthscale).pow(2).sum(-1)
    return outputscale * torch.exp(-0.5 * d2)


class SVGP(nn.Module):
    """A sparse variational GP (Hensman et al.) in the whitened parametrisation: inducing
    points ``Z``, ``q(v) = N(m, L L^T)`` with ``u = chol(Kzz) v``; the lower-triangular
    ``L`` trained as it is (the bug: its diagonal is not kept positive, GPyTorch's
    ``CholeskyVariationalDistribution`` trains it so too but takes the log of its absolute
    value). Returns the predictive mean and variance and the KL to the prior."""

    def __init__(self, m: int = 8, d_in: int = 2, s0: float = 0.1):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.z = nn.Parameter(torch.rand(m, d_in, generator=g) * 4)
        self.m = nn.Parameter(torch.zeros(m))
        self.chol = nn.Parameter(torch.eye(m) * s0)
        self.raw_lengthscale = nn.Parameter(torch.zeros(d_in))
        self.raw_outputscale = nn.Parameter(torch.zeros(()))

    def forward(self, x):
        ls, os = F.softplus(self.raw_lengthscale), F.softplus(self.raw_outputscale)
        kzz = rbf(self.z, self.z, ls, os) + 1e-4 * torch.eye(len(self.z))
        lz = torch.linalg.cholesky(kzz)
        a = torch.linalg.solve_triangular(lz, rbf(self.z, x, ls, os), upper=False)
        s_chol = torch.tril(self.chol)
        mean = a.T @ self.m
        var = (os - a.pow(2).sum(0) + (s_chol.T @ a).pow(2).sum(0)).clamp_min(1e-6)
        kl = 0.5 * ((s_chol ** 2).sum() + self.m @ self.m - len(self.m)
                    - 2 * torch.log(torch.diagonal(s_chol)).sum())
        return mean, var, kl


def make_svgp(**kw):
    torch.manual_seed(0)
    return SVGP(**kw)


def svgp_elbo(out, y, noise: float = 0.01, n_data: int = 256):
    """The negative ELBO per data point: the expected Gaussian log-likelihood under q(f),
    then the KL over the data set's size."""
    mean, var, kl = out
    ell = -0.5 * (math.log(2 * math.pi * noise) + ((y - mean) ** 2 + var) / noise)
    return -ell.mean() + kl / n_data


class LinearSVDO(nn.Module):
    """Sparse variational dropout (Molchanov et al. 2017): weights ``theta`` with a learned
    ``log_sigma``; ``log_alpha = 2 log_sigma - log(theta**2)``, clamped to [-8, 8] as the
    paper's code does, but without its 1e-8 under the log (the bug: a weight of exactly 0, a
    bias initialised to zeros, makes log(0) = -inf, which the clamp takes to 8 in the forward
    while its backward multiplies the log's infinite derivative by the clamp's 0)."""

    def __init__(self, d_in, d_out, bias_init: float = 0.0):
        super().__init__()
        self.theta = nn.Parameter(torch.randn(d_out, d_in) * 0.3)
        self.bias = nn.Parameter(torch.full((d_out,), bias_init))
        self.log_sigma = nn.Parameter(torch.full((d_out, d_in), -5.0))
        self.bias_log_sigma = nn.Parameter(torch.full((d_out,), -5.0))

    def _log_alpha(self, w, log_sigma):
        return torch.clamp(2 * log_sigma - torch.log(w ** 2), -8, 8)

    def forward(self, x):
        mean = F.linear(x, self.theta, self.bias)
        std = torch.sqrt(F.linear(x ** 2, torch.exp(2 * self.log_sigma)) + 1e-8)
        return mean + std * torch.randn_like(mean)

    def kl_reg(self):
        k1, k2, k3 = 0.63576, 1.8732, 1.48695
        kl = 0.0
        for w, s in ((self.theta, self.log_sigma), (self.bias, self.bias_log_sigma)):
            la = self._log_alpha(w, s)
            kl = kl + (k1 - k1 * torch.sigmoid(k2 + k3 * la) + 0.5 * torch.log1p(torch.exp(-la))
                       ).sum()
        return kl


class SVDONet(nn.Module):
    def __init__(self, d_in=4, hidden=16):
        super().__init__()
        self.l1 = LinearSVDO(d_in, hidden)
        self.l2 = LinearSVDO(hidden, 1)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x))).squeeze(-1)

    def kl(self):
        return self.l1.kl_reg() + self.l2.kl_reg()


def make_svdo():
    torch.manual_seed(0)
    return SVDONet()


def svdo_elbo(out, y, kl, kl_weight: float = 1e-3):
    """The sparse VD objective: the data term plus the weighted KL, the KL passed in."""
    return F.mse_loss(out, y) + kl_weight * kl


class NaturalGaussian(nn.Module):
    """Heteroscedastic regression in the Gaussian's natural parameters (Immer et al. 2023):
    ``eta1 = f1``, ``eta2 = -0.5 * exp(f2)`` (negative in exact arithmetic), so that the
    negative log-likelihood is convex in them."""

    def __init__(self, d_in: int = 4, hidden: int = 16):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, 2))

    def forward(self, x):
        f = self.body(x)
        return f[:, 0], -0.5 * torch.exp(f[:, 1])


def make_natural():
    torch.manual_seed(0)
    return NaturalGaussian()


def natural_nll(out, y):
    """-log N(y; mu, var) with mu = -eta1 / (2 eta2), var = -1 / (2 eta2), in eta."""
    eta1, eta2 = out
    return (-0.5 * torch.log(-2 * eta2) - eta1 ** 2 / (4 * eta2) - eta1 * y - eta2 * y ** 2
            ).mean()
