"""Neural arithmetic units and symbolic-regression networks, written the way their public
repositories write them; the factories of ``test_neural_arithmetic.py``.

- ``NAC`` / ``NALU``: kevinzakka/NALU-pytorch and AndreasMadsen/stable-nalu
  (``W = tanh(W_hat) * sigmoid(M_hat)``; the multiplicative path
  ``exp(W @ log(|x| + eps))``, a sigmoid gate mixing it with the additive path).
- ``INALU``: daniel-schloer/iNALU (separate add/mul weights, the exponent clipped at ``omega``,
  the sign restored as ``prod(sign(x) * |W| + 1 - |W|)``).
- ``NMU`` / ``NAU``: AndreasMadsen/stable-nalu (``prod(W * x + 1 - W)``, weights clamped to
  ``[0, 1]`` / ``[-1, 1]``, the sparsity regulariser ``min(|W|, 1 - |W|)``).
- ``EQL``: martius-lab/EQL and Sahoo et al. 2018 (a linear layer feeding identity, sin, cos,
  sigmoid and product units; the last layer's division unit ``x / y if y > theta else 0`` with
  the penalty ``max(theta - y, 0)``), plus symbolic-regression style units (sqrt, log, exp).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

IN = 4


class NAC(nn.Module):
    """Neural accumulator: a linear map with weights biased towards -1, 0, 1."""

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.W_hat = nn.Parameter(torch.empty(out_dim, in_dim))
        self.M_hat = nn.Parameter(torch.empty(out_dim, in_dim))
        nn.init.kaiming_uniform_(self.W_hat, a=math.sqrt(5))
        nn.init.kaiming_uniform_(self.M_hat, a=math.sqrt(5))

    def forward(self, x):
        W = torch.tanh(self.W_hat) * torch.sigmoid(self.M_hat)
        return F.linear(x, W)


class NALU(nn.Module):
    """NALU-pytorch's cell: gate * add + (1 - gate) * exp(W log(|x| + eps))."""

    def __init__(self, in_dim: int, out_dim: int, eps: float = 1e-10):
        super().__init__()
        self.nac = NAC(in_dim, out_dim)
        self.G = nn.Parameter(torch.empty(out_dim, in_dim))
        nn.init.kaiming_uniform_(self.G, a=math.sqrt(5))
        self.eps = eps

    def forward(self, x):
        a = self.nac(x)
        g = torch.sigmoid(F.linear(x, self.G))
        log_x = torch.log(torch.abs(x) + self.eps)
        m = torch.exp(self.nac(log_x))
        return g * a + (1 - g) * m


class INALU(nn.Module):
    """iNALU: separate weights, the log-space exponent clipped at ``omega`` (``None``: not
    clipped), the sign of the product restored from the inputs' signs."""

    def __init__(self, in_dim: int, out_dim: int, eps: float = 1e-7, omega: float | None = 20.0):
        super().__init__()
        self.add = NAC(in_dim, out_dim)
        self.mul = NAC(in_dim, out_dim)
        self.G = nn.Parameter(torch.zeros(out_dim))
        self.eps, self.omega = eps, omega

    def forward(self, x):
        a = self.add(x)
        e = self.mul(torch.log(torch.abs(x) + self.eps))
        if self.omega is not None:
            e = torch.clamp(e, max=self.omega)
        W = torch.abs(torch.tanh(self.mul.W_hat) * torch.sigmoid(self.mul.M_hat))
        msv = torch.prod(torch.sign(x)[:, None, :] * W + 1 - W, dim=-1)
        m = torch.exp(e) * msv
        g = torch.sigmoid(self.G)
        return g * a + (1 - g) * m


class NAU(nn.Module):
    """stable-nalu's ReRegualizedLinearNAC: weights clamped to [-1, 1] after each step."""

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.W = nn.Parameter(torch.empty(out_dim, in_dim))
        r = min(0.5, math.sqrt(3.0 / (in_dim + out_dim)))
        nn.init.uniform_(self.W, -r, r)

    def forward(self, x):
        return F.linear(x, torch.clamp(self.W, -1.0, 1.0))

    def regualizer(self):
        return torch.mean(torch.min(torch.abs(self.W), 1 - torch.abs(self.W)))


class NMU(nn.Module):
    """stable-nalu's ReRegualizedLinearMNAC: prod_i(W_i x_i + 1 - W_i), W in [0, 1]."""

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.W = nn.Parameter(torch.empty(out_dim, in_dim))
        nn.init.uniform_(self.W, 0.25, 0.75)

    def forward(self, x):
        W = torch.clamp(self.W, 0.0, 1.0)
        return torch.prod(x[:, None, :] * W + 1 - W, dim=-1)

    def regualizer(self):
        return torch.mean(torch.min(torch.abs(self.W), 1 - torch.abs(self.W)))


class NauNmu(nn.Module):
    """stable-nalu's "simple_function" network: an NAU then an NMU."""

    def __init__(self, hidden: int = 2):
        super().__init__()
        self.layer_1 = NAU(IN, hidden)
        self.layer_2 = NMU(hidden, 1)

    def forward(self, x):
        return self.layer_2(self.layer_1(x))

    def regualizer(self):
        return self.layer_1.regualizer() + self.layer_2.regualizer()


class ArithmeticNet(nn.Module):
    """Two stacked cells (NALU-pytorch's ``MultiLayerNALU``)."""

    def __init__(self, cell=NALU, hidden: int = 2, **kw):
        super().__init__()
        self.layer_1 = cell(IN, hidden, **kw)
        self.layer_2 = cell(hidden, 1, **kw)

    def forward(self, x):
        return self.layer_2(self.layer_1(x))


class SymbolicLayer(nn.Module):
    """An EQL hidden layer: a linear map into the units' arguments, then identity, sin, cos,
    sigmoid, one product unit, the symbolic-regression units sqrt / log / exp, and a division
    of a unit by the last input variable, protected as gplearn protects it (1 where
    ``|x| <= 0.001``)."""

    def __init__(self, in_dim: int, safe: bool = True, guarded: bool = True):
        super().__init__()
        self.linear = nn.Linear(in_dim, 9)
        self.safe, self.guarded = safe, guarded

    def forward(self, x):
        z = self.linear(x)
        if self.safe:  # DeepSymRegTorch's protected functions
            root = torch.sqrt(torch.abs(z[:, 5:6]) + 1e-6)
            log = torch.log(torch.abs(z[:, 6:7]) + 1e-6)
        else:
            root = torch.sqrt(z[:, 5:6])
            log = torch.log(z[:, 6:7])
        d = x[:, -1:]
        ok = torch.abs(d) > 0.001
        if self.guarded:
            ratio = torch.where(ok, z[:, 8:9] / torch.where(ok, d, torch.ones_like(d)), 1.0)
        else:  # gplearn's protected division, np.where(abs(x2) > 0.001, x1 / x2, 1.)
            ratio = torch.where(ok, z[:, 8:9] / d, torch.ones_like(d))
        return torch.cat([z[:, :1], torch.sin(z[:, 1:2]), torch.cos(z[:, 2:3]),
                          torch.sigmoid(z[:, 3:4]), z[:, 3:4] * z[:, 4:5], root, log,
                          torch.exp(z[:, 7:8]), ratio], dim=1)


class DivisionOutput(nn.Module):
    """EQL-div's output layer: ``x / y if y > theta else 0`` per output, and the penalty
    ``max(theta - y, 0)`` the loss adds."""

    def __init__(self, in_dim: int, theta: float = 1e-4):
        super().__init__()
        self.num = nn.Linear(in_dim, 1)
        self.den = nn.Linear(in_dim, 1)
        self.theta = theta

    def forward(self, h):
        x, y = self.num(h), self.den(h)
        mask = y > self.theta
        out = torch.where(mask, x / torch.where(mask, y, torch.ones_like(y)), torch.zeros_like(x))
        return out, F.relu(self.theta - y)


class EQLDiv(nn.Module):
    def __init__(self, safe: bool = True, guarded: bool = True):
        super().__init__()
        self.hidden = SymbolicLayer(IN, safe=safe, guarded=guarded)
        self.out = DivisionOutput(9)

    def forward(self, x):
        return self.out(self.hidden(x))


def make_nalu():
    torch.manual_seed(0)
    return ArithmeticNet(NALU)


def make_nalu_eps0():
    torch.manual_seed(0)
    return ArithmeticNet(NALU, eps=0.0)


def make_inalu():
    torch.manual_seed(0)
    return ArithmeticNet(INALU)


def make_inalu_unclipped():
    torch.manual_seed(0)
    return ArithmeticNet(INALU, omega=None)


def make_nau_nmu():
    torch.manual_seed(0)
    return NauNmu()


def make_eql():
    torch.manual_seed(0)
    return EQLDiv()


def make_eql_unguarded():
    torch.manual_seed(0)
    return EQLDiv(guarded=False)


def make_eql_unprotected():
    torch.manual_seed(0)
    return EQLDiv(safe=False)


def eql_loss(out, target, lam: float = 1.0):
    """MSE plus the penalty on denominators below theta (EQL-div's ``penalty_div``)."""
    pred, penalty = out
    return F.mse_loss(pred, target) + lam * penalty.mean()


class Arithmetic(torch.utils.data.Dataset):
    """stable-nalu's SimpleFunctionStaticDataset: a = sum of x[0:2], b = sum of x[1:3],
    target = op(a, b); inputs uniform in ``range_``; rows in ``zero_rows`` hold an exact 0
    in their last feature (a blank one), rows in ``big_rows`` are scaled by ``big`` (an extrapolation batch)."""

    def __init__(self, n: int, op=torch.mul, range_=(1.0, 2.0), zero_rows=(), big_rows=(),
                 big: float = 1.0, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        lo, hi = range_
        self.x = lo + (hi - lo) * torch.rand(n, IN, generator=g)
        for i in zero_rows:
            self.x[i, IN - 1] = 0.0
        for i in big_rows:
            self.x[i] *= big
        a, b = self.x[:, 0:2].sum(1), self.x[:, 1:3].sum(1)
        self.y = op(a, b)[:, None]

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def make_nalu_converged_add():
    """A NALU as training on addition leaves it: the NAC's weights saturated at 1, the gate
    choosing the additive path (sigmoid(G x) rounds to exactly 1 for inputs well above 1)."""
    torch.manual_seed(0)
    model = ArithmeticNet(NALU)
    with torch.no_grad():
        for cell in (model.layer_1, model.layer_2):
            cell.G.fill_(1.0)
            cell.nac.W_hat.fill_(5.0)
            cell.nac.M_hat.fill_(5.0)
    return model


def make_nalu_half():
    """NALU-pytorch's default eps 1e-10, the model cast with ``.half()``."""
    return make_nalu().half()


def make_nau_nmu_half():
    """stable-nalu's NAU -> NMU cast with ``.half()``."""
    return make_nau_nmu().half()


def l_half(model: nn.Module):
    """EQL's L_1/2 sparsity regulariser (Sahoo et al.) over the weight matrices, as written
    without the smoothing Kim et al. add near 0."""
    return sum(torch.sum(torch.abs(p) ** 0.5) for n, p in model.named_parameters()
               if n.endswith("weight"))


def trim(model: nn.Module, threshold: float = 0.05):
    """EQL's trimming phase: weights below the threshold are set to 0 and stay there."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("weight"):
                p[p.abs() < threshold] = 0.0


def eql_loss_sparse(out, target, model, lam: float = 1e-3):
    """EQL-div's loss plus the L_1/2 regulariser of ``model``'s weights."""
    return eql_loss(out, target) + lam * l_half(model)
