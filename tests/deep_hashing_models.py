"""Deep supervised hashing written the way its public repositories write it; the factories and
losses of ``test_deep_hashing.py``.

- ``HashNet``: a backbone (an MLP standing in for AlexNet's features) and a hash layer
  ``tanh(beta * fc(x))``; thuml/HashNet (``network.py``'s ``AlexNetFc``: ``scale`` grown by
  ``init_scale * (1 + gamma * iter_num) ** power`` every ``step_size`` iterations), with
  ``beta`` a plain attribute the loop grows. ``beta=1`` is DPSH's ``tanh`` code layer.
- ``GreedyHash``: ssppp/GreedyHash: ``sign(h)`` forward and the gradient passed straight
  through (a custom ``autograd.Function``), the classifier on the binary codes, the
  ``|h| - 1`` cubic penalty.
- ``dpsh_loss``: jiangqy/DPSH-pytorch (``calc_loss``): ``theta = 0.5 * u @ U.T``, the negative
  log likelihood ``log(1 + exp(theta)) - S * theta`` written as it is there, plus
  ``eta * ||u - sign(u)||^2``.
- ``hashnet_loss``: HashNet's weighted pairwise cross-entropy of ``sigmoid(alpha * <u, v>)``,
  the similar pairs weighted ``S.numel() / S.sum()`` (``pairwise_loss``'s ``S1``/``S0``
  balancing), written with ``log(sigmoid)`` (DeepHash-pytorch's first versions).
- ``quantization_atanh_loss``: the log-likelihood of a relaxed code read back through
  ``atanh`` (HashNet-style continuation with a loss on the pre-activation ``atanh(h)/beta``).
- ``csq_loss``: yuanli2333/Hadamard-Matrix-for-hashing (central similarity quantization):
  Hadamard hash centres, the BCE of ``(h + 1) / 2`` against ``(c + 1) / 2`` written by hand,
  plus ``lambda * (|h| - 1)^2``.
- ``bit_balance``/``decorrelation``: the code mean per bit and ``||H^T H / n - I||``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FEATURES, HIDDEN, BITS, CLASSES, BATCH = 16, 32, 16, 4, 8


def hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def images(g: torch.Generator, n: int, scale: float = 1.0):
    """Class-clustered features (pixels in [0, 1] after ``/ 255`` when ``scale`` is 1) and
    one-hot labels."""
    y = torch.arange(n) % CLASSES
    means = torch.rand(CLASSES, FEATURES, generator=g)
    x = (means[y] + 0.1 * torch.rand(n, FEATURES, generator=g)).clamp(0, 1) * scale
    return x, F.one_hot(y, CLASSES).float()


class Backbone(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        return F.relu(self.fc2(F.relu(self.fc1(x))))


class HashLayer(nn.Module):
    def __init__(self, beta: float = 1.0):
        super().__init__()
        self.fc = nn.Linear(HIDDEN, BITS)
        self.beta = beta

    def forward(self, x):
        return torch.tanh(self.beta * self.fc(x))


class HashNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = Backbone()
        self.hash_layer = HashLayer()

    def forward(self, x):
        return self.hash_layer(self.backbone(x))


class SignST(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h):
        return h.sign()

    @staticmethod
    def backward(ctx, g):
        return g


class GreedyHash(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = Backbone()
        self.hash_fc = nn.Linear(HIDDEN, BITS)
        self.classifier = nn.Linear(BITS, CLASSES)

    def forward(self, x):
        h = self.hash_fc(self.backbone(x))
        b = SignST.apply(h)
        return self.classifier(b), h


class CentreHash(nn.Module):
    """A HashNet whose hash centres are learned (a parameter per class), initialised from a
    Hadamard matrix."""

    def __init__(self):
        super().__init__()
        self.net = HashNet()
        self.centres = nn.Parameter(hadamard(BITS)[:CLASSES].clone())

    def forward(self, x, y):
        return self.net(x), y @ self.centres


def make_hashnet():
    torch.manual_seed(0)
    return HashNet()


def make_greedy():
    torch.manual_seed(0)
    return GreedyHash()


def make_centre_hash():
    torch.manual_seed(0)
    return CentreHash()


# --------------------------------------------------------------------------------------------
# losses


def similarity(y1, y2):
    return (y1 @ y2.T > 0).float()


def dpsh_loss(u, y, U, Y, eta: float = 0.1):
    S = similarity(y, Y)
    theta = 0.5 * u @ U.T
    likelihood = (torch.log(1 + torch.exp(theta)) - S * theta).mean()
    quantization = (u - u.sign()).pow(2).mean()
    return likelihood + eta * quantization


def hashnet_loss(u, y, alpha: float = 1.0, symmetric: bool = False):
    S = similarity(y, y)
    dot = alpha * u @ u.T
    p = torch.sigmoid(dot)
    q = torch.sigmoid(-dot) if symmetric else 1 - p  # (the dissimilar pairs' probability)
    w = torch.where(S > 0, S.numel() / S.sum(), S.numel() / (1 - S).sum())
    nll = -(S * torch.log(p) + (1 - S) * torch.log(q))
    return (w * nll).mean()


def hashnet_balanced_loss(u, y, alpha: float = 0.1):
    """HashNet's weights the way its ``pairwise_loss`` divides them: each pair kind's sum by
    its count, over the pairs ``i != j``."""
    off = 1 - torch.eye(len(u))
    S = similarity(y, y) * off
    dot = alpha * u @ u.T
    nll = F.softplus(dot) - S * dot
    return (nll * S).sum() / S.sum() + (nll * (1 - S) * off).sum() / ((1 - S) * off).sum()


def dsh_loss(u, y, margin: float = 4.0, alpha: float = 0.01):
    """weixu000/DSH-pytorch's contrastive loss over the pairs ``i < j`` with the Euclidean
    distance (the paper's ``||b_i - b_j||``) rather than its square."""
    i, j = torch.triu_indices(len(u), len(u), 1)
    S = similarity(y, y)[i, j]
    dist = ((u[i] - u[j]) ** 2).sum(1).sqrt()
    pair = S * dist ** 2 / 2 + (1 - S) * (margin - dist).clamp(min=0) ** 2 / 2
    return pair.mean() + alpha * (u.abs() - 1).abs().mean()


def greedy_pairwise_loss(out, y):
    """GreedyHash's classifier loss plus DPSH's pairwise likelihood on the relaxed codes."""
    logits, h = out
    S = similarity(y, y)
    theta = 0.5 * h @ h.T
    return F.cross_entropy(logits, y.argmax(1)) + (torch.log(1 + torch.exp(theta))
                                                   - S * theta).mean()


def quantization_atanh_loss(u, y, beta: float):
    """The continuation loss on the pre-activation: ``atanh(u) / beta`` pulled to the code."""
    z = torch.atanh(u) / beta
    S = similarity(y, y)
    dot = 0.1 * z @ z.T
    return (F.softplus(dot) - S * dot).mean()


def norm_quantization_loss(u, y):
    """DPSH's pairwise term plus the quantization error as a distance ``||u - sign(u)||``."""
    S = similarity(y, y)
    dot = 0.5 * u @ u.T
    q = torch.sqrt(((u - u.sign()) ** 2).sum(1))
    return (F.softplus(dot) - S * dot).mean() + 0.1 * q.mean()


def csq_loss(out, lam: float = 1e-4):
    """Central similarity quantization with the BCE written out."""
    h, c = out
    p, t = (h + 1) / 2, (c.sign() + 1) / 2
    bce = -(t * torch.log(p) + (1 - t) * torch.log(1 - p)).mean()
    return bce + lam * (h.abs() - 1).pow(2).mean()


def greedy_loss(out, y, alpha: float = 0.1):
    logits, h = out
    return F.cross_entropy(logits, y.argmax(1)) + alpha * (h.abs() - 1).pow(3).abs().mean()


def bit_balance(u):
    return u.mean(0).pow(2).mean()


def decorrelation(u):
    n = u.shape[0]
    return ((u.T @ u) / n - torch.eye(u.shape[1])).pow(2).mean()


def dpsh_bank_loss(u, y, U, Y, eta: float = 0.1):
    """DPSH's loss against the bank of every training code (``U``, labels ``Y``)."""
    S = similarity(y, Y)
    theta = 0.5 * u @ U.T
    likelihood = (torch.log(1 + torch.exp(theta)) - S * theta).mean()
    return likelihood + eta * (u - u.sign()).pow(2).mean()


def decorrelated_loss(u, y):
    """A pairwise loss plus the bits' correlation matrix pulled to the identity (bits
    standardised over the batch)."""
    S = similarity(y, y)
    dot = 0.5 * u @ u.T
    z = (u - u.mean(0)) / u.std(0)
    corr = z.T @ z / (len(u) - 1)
    return (F.softplus(dot) - S * dot).mean() + 0.01 * (corr - torch.eye(BITS)).pow(2).mean()


def entropy_balanced_loss(u, y, gamma: float = 0.1):
    """A pairwise loss plus bit balance as each bit's entropy over the batch: the fraction of
    +1s ``p = (mean + 1) / 2`` pushed to one half."""
    S = similarity(y, y)
    dot = 0.5 * u @ u.T
    p = (u.mean(0) + 1) / 2
    entropy = -(p * torch.log(p) + (1 - p) * torch.log(1 - p))
    return (F.softplus(dot) - S * dot).mean() - gamma * entropy.mean()


def dch_loss(u, y, gamma: float = 20.0, lam: float = 0.1):
    """Deep Cauchy Hashing (DeepHash-pytorch's ``DCHLoss``): the normalised Hamming distance
    ``d = bits / 2 * (1 - cos(u_i, u_j))`` under a Cauchy kernel, over every pair of the batch,
    the similar pairs weighted by the batch's balance."""
    S = similarity(y, y)
    cos = (u @ u.T) / (u.norm(dim=1, keepdim=True) * u.norm(dim=1, keepdim=True).T)
    d = BITS / 2 * (1 - cos)
    w = torch.where(S > 0, S.numel() / S.sum(), S.numel() / (1 - S).sum())
    cauchy = S * torch.log(d / gamma) + torch.log(1 + gamma / d)
    quantization = torch.log(1 + (u.abs() - 1).abs().sum(1) / gamma)
    return (w * cauchy).mean() + lam * quantization.mean()


class DPSHLoss(nn.Module):
    """DeepHash-pytorch's ``DPSHLoss``: the bank of every training code ``U`` and its labels
    ``Y`` held by the loss as plain tensors, the batch's rows written in ``forward``."""

    def __init__(self, num_train: int, eta: float = 0.1, fill: float = 0.0):
        super().__init__()
        self.U = torch.full((num_train, BITS), fill)
        self.Y = torch.zeros(num_train, CLASSES)
        self.eta = eta

    def forward(self, u, y, ind):
        self.U[ind] = u.data
        self.Y[ind] = y.float()
        s = (y @ self.Y.t() > 0).float()
        inner_product = u @ self.U.t() * 0.5
        likelihood_loss = (1 + (-(inner_product.abs())).exp()).log() \
            + inner_product.clamp(min=0) - s * inner_product
        quantization_loss = self.eta * (u - u.sign()).pow(2).mean()
        return likelihood_loss.mean() + quantization_loss


def hashnet_dh_loss(u, y, alpha: float = 0.1):
    """DeepHash-pytorch's ``HashNetLoss`` over the pairs ``i != j`` of the batch: the stable
    pairwise loss, each kind of pair reweighted in place by ``S / S1`` and ``S / S0``."""
    off = ~torch.eye(len(u), dtype=torch.bool)
    similarity = (y @ y.t() > 0).float()[off]
    dot_product = (alpha * u @ u.t())[off]
    exp_loss = (1 + (-dot_product.abs()).exp()).log() + dot_product.clamp(min=0) \
        - similarity * dot_product
    S1 = (similarity > 0).float().sum()
    S0 = (similarity <= 0).float().sum()
    S = S0 + S1
    exp_loss[similarity > 0] = exp_loss[similarity > 0] * (S / S1)
    exp_loss[similarity <= 0] = exp_loss[similarity <= 0] * (S / S0)
    return exp_loss.sum() / S
