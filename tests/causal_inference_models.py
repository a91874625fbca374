"""Causal-inference models of ``tests/test_causal_inference.py``, written the way their public
repositories write them: DragonNet (claudiashi57/dragonnet, and its PyTorch port
farazmah/dragonnet-pytorch: a shared ELU representation, two outcome heads, a sigmoid
propensity head and targeted regularisation's epsilon), CFRNet / TARNet
(clinicalml/cfrnet: a ReLU representation, two outcome heads, an IPM penalty between the
treated and control representations, linear MMD or Wasserstein) and a TARNet trained with
inverse propensity weights (trimmed, as causalml/econml trim them). The factories live at
module level so that ``nanreplay`` rebuilds them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

N_FEAT = 6


def trial(n: int = 128, seed: int = 0):
    """Covariates, a treatment confounded by x0 and an outcome with effect 1 + x1."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, N_FEAT, generator=g)
    t = (torch.rand(n, generator=g) < torch.sigmoid(1.5 * x[:, 0])).float()
    y = x[:, 0] + 0.5 * x[:, 2] + t * (1 + x[:, 1]) + 0.1 * torch.randn(n, generator=g)
    return x, t, y


class DragonNet(nn.Module):
    """farazmah/dragonnet-pytorch's ``DragonNetBase``: ``z`` shared, ``t_pred`` a sigmoid of
    one linear unit, ``y0``/``y1`` two-layer heads, ``epsilon`` a Linear(1, 1) of ones."""

    def __init__(self, shared: int = 32, outcome: int = 16):
        super().__init__()
        self.fc1 = nn.Linear(N_FEAT, shared)
        self.fc2 = nn.Linear(shared, shared)
        self.fcz = nn.Linear(shared, shared)
        self.t_predictions = nn.Linear(shared, 1)
        self.y0_fc1, self.y0_fc2 = nn.Linear(shared, outcome), nn.Linear(outcome, outcome)
        self.y0_out = nn.Linear(outcome, 1)
        self.y1_fc1, self.y1_fc2 = nn.Linear(shared, outcome), nn.Linear(outcome, outcome)
        self.y1_out = nn.Linear(outcome, 1)
        self.epsilon = nn.Linear(1, 1)

    def forward(self, inputs):
        z = F.elu(self.fcz(F.elu(self.fc2(F.elu(self.fc1(inputs))))))
        t_pred = torch.sigmoid(self.t_predictions(z))
        y0 = self.y0_out(F.elu(self.y0_fc2(F.elu(self.y0_fc1(z)))))
        y1 = self.y1_out(F.elu(self.y1_fc2(F.elu(self.y1_fc1(z)))))
        eps = self.epsilon(torch.ones_like(t_pred)[:, 0:1])
        return y0, y1, t_pred, eps


def make_dragonnet() -> nn.Module:
    torch.manual_seed(0)
    return DragonNet()


def dragonnet_loss(y_true, t_true, t_pred, y0_pred, y1_pred):
    loss_t = torch.sum(F.binary_cross_entropy(t_pred, t_true))
    loss0 = torch.sum((1.0 - t_true) * torch.square(y_true - y0_pred))
    loss1 = torch.sum(t_true * torch.square(y_true - y1_pred))
    return loss0 + loss1 + loss_t


def tarreg_loss(out, y_true, t_true, alpha: float = 1.0, beta: float = 1.0):
    """The port's ``tarreg_loss``: the propensity kept inside [0.01/1.02, 1.01/1.02] before
    the clever covariate ``h`` divides by it."""
    y0_pred, y1_pred, t_pred, eps = out
    y_true, t_true = y_true[:, None], t_true[:, None]
    t_pred = (t_pred + 0.01) / 1.02
    vanilla_loss = dragonnet_loss(y_true, t_true, t_pred, y0_pred, y1_pred)
    y_pred = t_true * y1_pred + (1 - t_true) * y0_pred
    h = (t_true / t_pred) - ((1 - t_true) / (1 - t_pred))
    y_pert = y_pred + eps * h
    targeted_regularization = torch.sum((y_true - y_pert) ** 2)
    return vanilla_loss + beta * targeted_regularization


class CFRNet(nn.Module):
    """clinicalml/cfrnet's network: a ReLU representation ``h_rep`` (normalised or not), and
    the outcome of each arm from its own head on it (TARNet when the IPM weight is 0)."""

    def __init__(self, rep: int = 16, hidden: int = 16):
        super().__init__()
        self.rep = nn.Sequential(nn.Linear(N_FEAT, rep), nn.ReLU(), nn.Linear(rep, rep),
                                 nn.ReLU())
        self.head0 = nn.Sequential(nn.Linear(rep, hidden), nn.ELU(), nn.Linear(hidden, 1))
        self.head1 = nn.Sequential(nn.Linear(rep, hidden), nn.ELU(), nn.Linear(hidden, 1))

    def forward(self, x, t):
        h_rep = self.rep(x)
        y0, y1 = self.head0(h_rep).squeeze(-1), self.head1(h_rep).squeeze(-1)
        return torch.where(t > 0, y1, y0), h_rep


def make_cfrnet() -> nn.Module:
    torch.manual_seed(0)
    return CFRNet()


def mmd2_lin(h_rep, t, p: float = 0.5):
    """cfrnet's ``mmd2_lin``: the squared distance of the arms' mean representations."""
    mean_control = h_rep[t == 0].mean(0)
    mean_treated = h_rep[t == 1].mean(0)
    return torch.sum(torch.square(2.0 * p * mean_treated - 2.0 * (1.0 - p) * mean_control))


def pdist2sq(X, Y):
    C = -2 * X @ Y.t()
    nx = torch.sum(X ** 2, 1, keepdim=True)
    ny = torch.sum(Y ** 2, 1, keepdim=True)
    return C + ny.t() + nx


def wasserstein(h_rep, t, p: float = 0.5, lam: float = 10.0, its: int = 10):
    """cfrnet's ``wasserstein`` (Sinkhorn over the treated x control distances), with
    ``torch.sqrt`` where cfrnet wrote ``safe_sqrt`` (``sqrt(clip(x, 1e-10, inf))``)."""
    Xt, Xc = h_rep[t == 1], h_rep[t == 0]
    M = torch.sqrt(pdist2sq(Xt, Xc).clamp_min(0))
    delta = M.max().detach()
    eff_lam = lam / M.mean().detach()
    K = torch.exp(-eff_lam * M) + 1e-6
    a = torch.full((Xt.shape[0], 1), p / Xt.shape[0])
    b = torch.full((Xc.shape[0], 1), (1 - p) / Xc.shape[0])
    u = a
    for _ in range(its):
        u = a / (K @ (b / (K.t() @ u)))
    v = b / (K.t() @ u)
    T = u * (v.t() * K)
    return torch.sum(T.detach() * M) + 0 * delta


P_TREATED = 0.125  # the training set's share of treated units (cfrnet's ``p_t``)


def cfr_loss(out, y, t, alpha: float = 1.0, ipm=mmd2_lin):
    """cfrnet's objective: the factual MSE reweighted by the training set's arm sizes, plus
    alpha times the IPM between the arms' representations."""
    y_pred, h_rep = out
    p_t = P_TREATED
    w = t / (2 * p_t) + (1 - t) / (2 * (1 - p_t))
    risk = torch.mean(w * (y - y_pred) ** 2)
    return risk + alpha * ipm(h_rep, t, p_t)


def cfr_wass_loss(out, y, t):
    return cfr_loss(out, y, t, alpha=1.0, ipm=wasserstein)


class IPWTARNet(nn.Module):
    """A TARNet with a propensity head (``e = sigmoid(logit)``), its outcome loss weighted by
    the inverse propensity of the observed arm."""

    def __init__(self, rep: int = 16):
        super().__init__()
        self.rep = nn.Sequential(nn.Linear(N_FEAT, rep), nn.ELU(), nn.Linear(rep, rep), nn.ELU())
        self.head0, self.head1 = nn.Linear(rep, 1), nn.Linear(rep, 1)
        self.prop = nn.Linear(N_FEAT, 1)

    def forward(self, x):
        z = self.rep(x)
        return self.head0(z).squeeze(-1), self.head1(z).squeeze(-1), self.prop(x).squeeze(-1)


def make_ipw_tarnet() -> nn.Module:
    torch.manual_seed(0)
    return IPWTARNet()


def snipw_loss(out, y, t, trim: float = 0.01):
    """Self-normalised IPW: weights t/e + (1-t)/(1-e), e trimmed to [trim, 1 - trim] (as
    causalml's ``trim_eps``), divided by their sum; the arms' mean outcomes only where the
    batch has that arm."""
    y0, y1, logit = out
    e = torch.sigmoid(logit).detach().clamp(trim, 1 - trim)
    w = t / e + (1 - t) / (1 - e)
    y_pred = torch.where(t > 0, y1, y0)
    outcome = (w * (y - y_pred) ** 2).sum() / w.sum()
    return outcome + F.binary_cross_entropy_with_logits(logit, t)


def ipw_loss(out, y, t):
    """The same objective with the propensity learnt through the weights and left untrimmed
    (``e`` a float32 sigmoid, 0 or 1 once the logit passes about ±17)."""
    y0, y1, logit = out
    e = torch.sigmoid(logit)
    w = t / e + (1 - t) / (1 - e)  # (untrimmed)
    y_pred = torch.where(t > 0, y1, y0)
    outcome = (w * (y - y_pred) ** 2).sum() / w.sum()
    return outcome + F.binary_cross_entropy(e, t)


class CATENet(nn.Module):
    """The DR-learner's second stage (Kennedy 2020; econml's ``DRLearner``, causalml's
    ``BaseDRLearner``): a network of the covariates regressed on the pseudo-outcomes."""

    def __init__(self, hidden: int = 16):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(N_FEAT, hidden), nn.ELU(), nn.Linear(hidden, 1))

    def forward(self, x):
        return self.net(x).squeeze(-1)


def make_catenet() -> nn.Module:
    torch.manual_seed(0)
    return CATENet()


def dr_pseudo_outcome_loss(tau, y, t, mu0, mu1, e):
    """The DR-learner's squared error to the doubly robust pseudo-outcome, from the first
    stage's cross-fitted outcome predictions and propensity ``e`` (a gradient-boosted
    classifier's ``predict_proba``), which ``causalml``'s ``trim_eps`` would have clipped."""
    mu_t = torch.where(t > 0, mu1, mu0)
    pseudo = (t - e) / (e * (1 - e)) * (y - mu_t) + mu1 - mu0
    return F.mse_loss(tau, pseudo)


def transformed_outcome_loss(tau, y, t):
    """The uplift tree/network's transformed outcome (Athey & Imbens; scikit-uplift's
    ``TransformedOutcome`` target), ``y * (t - p) / (p * (1 - p))``, with ``p`` the batch's
    share of treated units, as a randomised trial's notebooks estimate it."""
    p = t.mean()
    z = y * (t - p) / (p * (1 - p))
    return F.mse_loss(tau, z)


def cfr_loss_guarded(out, y, t, alpha: float = 1.0):
    """cfr_loss with the IPM taken only where the batch holds both arms (as the PyTorch ports
    of cfrnet guard it): a one-armed batch trains the factual loss alone."""
    if bool((t == 1).any()) and bool((t == 0).any()):
        return cfr_loss(out, y, t, alpha)
    return cfr_loss(out, y, t, alpha=0.0, ipm=lambda h, t, p: h.new_zeros(()))
