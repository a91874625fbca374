"""Models for ``tests/test_kan_splines.py``: Kolmogorov-Arnold networks as efficient-kan and
pykan write them (a SiLU base branch plus a B-spline branch whose bases come from the Cox-de
Boor recursion over a knot grid, the grid refitted from the activations' quantiles with
``torch.linalg.lstsq``), their L1 + entropy regularisation, and a Chebyshev KAN layer
(``cos(k * acos(tanh(x)))``, as ChebyKAN writes it).

Factories are named ``make_*``; tests record with ``factory="kan_splines_models:make_*"`` and
replay from this directory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

D_IN, HIDDEN, D_OUT = 4, 6, 1


class KANLinear(nn.Module):
    """efficient-kan's layer: ``silu(x) @ base_weight.T`` plus the B-spline branch."""

    # torch's CPU default, gelsy, is not bit-reproducible run to run under MKL; gelsd is
    driver: str | None = "gelsd"

    def __init__(self, in_features, out_features, grid_size=5, spline_order=3,
                 scale_noise=0.1, grid_eps=0.02, grid_range=(-1.0, 1.0)):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.grid_size, self.spline_order, self.grid_eps = grid_size, spline_order, grid_eps
        h = (grid_range[1] - grid_range[0]) / grid_size
        grid = (torch.arange(-spline_order, grid_size + spline_order + 1) * h
                + grid_range[0]).expand(in_features, -1).contiguous()
        self.register_buffer("grid", grid)
        self.base_weight = nn.Parameter(torch.empty(out_features, in_features))
        self.spline_weight = nn.Parameter(
            torch.empty(out_features, in_features, grid_size + spline_order))
        self.spline_scaler = nn.Parameter(torch.empty(out_features, in_features))
        nn.init.kaiming_uniform_(self.base_weight, a=5 ** 0.5)
        with torch.no_grad():
            noise = ((torch.rand(grid_size + 1, in_features, out_features) - 0.5)
                     * scale_noise / grid_size)
            self.spline_weight.copy_(self.curve2coeff(
                self.grid.T[spline_order:-spline_order], noise))
        nn.init.kaiming_uniform_(self.spline_scaler, a=5 ** 0.5)

    def b_splines(self, x):
        """Cox-de Boor: order-0 indicator bases, raised one order per pass."""
        grid = self.grid  # (in, grid_size + 2 * spline_order + 1)
        x = x.unsqueeze(-1)
        bases = ((x >= grid[:, :-1]) & (x < grid[:, 1:])).to(x.dtype)
        for k in range(1, self.spline_order + 1):
            bases = (
                (x - grid[:, : -(k + 1)]) / (grid[:, k:-1] - grid[:, : -(k + 1)]) * bases[:, :, :-1]
            ) + ((grid[:, k + 1:] - x) / (grid[:, k + 1:] - grid[:, 1:(-k)]) * bases[:, :, 1:])
        return bases.contiguous()  # (batch, in, grid_size + spline_order)

    def curve2coeff(self, x, y):
        """The spline coefficients whose curves pass through ``y`` at ``x`` (least squares)."""
        A = self.b_splines(x).transpose(0, 1)  # (in, batch, coeff)
        B = y.transpose(0, 1)  # (in, batch, out)
        solution = torch.linalg.lstsq(A, B, driver=self.driver).solution  # (in, coeff, out)
        return solution.permute(2, 0, 1).contiguous()

    @property
    def scaled_spline_weight(self):
        return self.spline_weight * self.spline_scaler.unsqueeze(-1)

    def forward(self, x):
        base_output = F.linear(F.silu(x), self.base_weight)
        spline_output = F.linear(self.b_splines(x).view(x.size(0), -1),
                                 self.scaled_spline_weight.view(self.out_features, -1))
        return base_output + spline_output

    @torch.no_grad()
    def update_grid(self, x, margin=0.01):
        """efficient-kan's grid update: knots at the batch's quantiles (mixed with a uniform
        grid by ``grid_eps``), coefficients refitted so the curves stay the same."""
        batch = x.size(0)
        splines = self.b_splines(x).permute(1, 0, 2)  # (in, batch, coeff)
        orig_coeff = self.scaled_spline_weight.permute(1, 2, 0)  # (in, coeff, out)
        unreduced = torch.bmm(splines, orig_coeff).permute(1, 0, 2)  # (batch, in, out)
        x_sorted = torch.sort(x, dim=0)[0]
        grid_adaptive = x_sorted[torch.linspace(0, batch - 1, self.grid_size + 1,
                                                dtype=torch.int64)]
        uniform_step = (x_sorted[-1] - x_sorted[0] + 2 * margin) / self.grid_size
        grid_uniform = (torch.arange(self.grid_size + 1, dtype=torch.float32).unsqueeze(1)
                        * uniform_step + x_sorted[0] - margin)
        grid = self.grid_eps * grid_uniform + (1 - self.grid_eps) * grid_adaptive
        grid = torch.cat([
            grid[:1] - uniform_step * torch.arange(self.spline_order, 0, -1).unsqueeze(1),
            grid,
            grid[-1:] + uniform_step * torch.arange(1, self.spline_order + 1).unsqueeze(1),
        ], dim=0)
        self.grid.copy_(grid.T)
        self.spline_weight.data.copy_(self.curve2coeff(x, unreduced))

    def regularization_loss(self, regularize_activation=1.0, regularize_entropy=1.0):
        l1_fake = self.spline_weight.abs().mean(-1)
        reg_activation = l1_fake.sum()
        p = l1_fake / reg_activation
        reg_entropy = -torch.sum(p * p.log())
        return regularize_activation * reg_activation + regularize_entropy * reg_entropy


class KAN(nn.Module):
    def __init__(self, widths=(D_IN, HIDDEN, D_OUT), grid_eps=0.02):
        super().__init__()
        self.layers = nn.ModuleList(KANLinear(i, o, grid_eps=grid_eps)
                                    for i, o in zip(widths[:-1], widths[1:]))

    def forward(self, x, update_grid=False):
        for layer in self.layers:
            if update_grid:
                layer.update_grid(x)
            x = layer(x)
        return x

    def update_grid_from_samples(self, x):
        """pykan's: each layer's grid from the activations reaching it, layer by layer."""
        for layer in self.layers:
            layer.update_grid(x)
            x = layer(x)

    def regularization_loss(self, regularize_activation=1.0, regularize_entropy=1.0):
        return sum(layer.regularization_loss(regularize_activation, regularize_entropy)
                   for layer in self.layers)


def make_kan():
    torch.manual_seed(0)
    return KAN()


def make_adaptive_kan():
    """Knots at the quantiles only (``grid_eps=0``): pykan's "adaptive" grid."""
    torch.manual_seed(0)
    model = KAN(grid_eps=0.0)
    for layer in model.layers:
        layer.driver = None  # torch's default driver (gelsy on CPU), as efficient-kan calls it
    return model


class PykanLayer(nn.Module):
    """pykan's KANLayer idea in brief: per-edge activations phi(x) kept for the regulariser
    (``acts_scale``: the mean |phi| of each edge over the batch), summed into the outputs."""

    def __init__(self, in_dim, out_dim, base_fun=True):
        super().__init__()
        self.kan = KANLinear(in_dim, out_dim)
        self.base_fun = base_fun  # pykan's base_fun='zero': splines only

    def forward(self, x):
        k = self.kan
        phi = torch.einsum("bic,oic->boi", k.b_splines(x), k.scaled_spline_weight)
        if self.base_fun:
            phi = phi + F.silu(x)[:, None, :] * k.base_weight
        self.acts_scale = phi.abs().mean(0)  # (out, in), read by the regulariser
        return phi.sum(-1)


class PykanNet(nn.Module):
    def __init__(self, base_fun=True):
        super().__init__()
        self.l0 = PykanLayer(D_IN, HIDDEN, base_fun)
        self.l1 = PykanLayer(HIDDEN, D_OUT, base_fun)

    def forward(self, x):
        return self.l1(self.l0(x))


def make_pykan():
    torch.manual_seed(0)
    return PykanNet()


def make_spline_only_pykan():
    torch.manual_seed(0)
    return PykanNet(base_fun=False)


def pykan_reg(model, lamb_l1=1.0, lamb_entropy=2.0):
    """pykan's ``reg``: L1 of each layer's edge scales plus the entropy of their shares."""
    reg = 0.0
    for layer in (model.l0, model.l1):
        acts = layer.acts_scale
        l1 = torch.sum(acts)
        p = acts / l1  # BUG (planted): a layer whose activations are all 0 gives 0/0
        entropy = -torch.sum(p * torch.log(p))
        reg = reg + lamb_l1 * l1 + lamb_entropy * entropy
    return reg


class ChebyKANLayer(nn.Module):
    """ChebyKAN: Chebyshev polynomials T_k(tanh x) = cos(k * acos(tanh x)), learned mixing."""

    def __init__(self, input_dim, output_dim, degree=4):
        super().__init__()
        self.inputdim, self.outdim, self.degree = input_dim, output_dim, degree
        self.cheby_coeffs = nn.Parameter(torch.empty(input_dim, output_dim, degree + 1))
        nn.init.normal_(self.cheby_coeffs, mean=0.0, std=1 / (input_dim * (degree + 1)))
        self.register_buffer("arange", torch.arange(0, degree + 1, 1))

    def forward(self, x):
        x = torch.tanh(x)  # Chebyshev polynomials live on [-1, 1]
        x = x.view((-1, self.inputdim, 1)).expand(-1, -1, self.degree + 1)
        x = x.acos()
        x = x * self.arange
        x = x.cos()
        y = torch.einsum("bid,iod->bo", x, self.cheby_coeffs)
        return y.view(-1, self.outdim)


class ChebyKAN(nn.Module):
    """A linear stem, then ChebyKAN layers (the stem's outputs go through tanh unnormalised)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(D_IN, HIDDEN)
        self.c0 = ChebyKANLayer(HIDDEN, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.c1 = ChebyKANLayer(HIDDEN, D_OUT)

    def forward(self, x):
        return self.c1(self.norm(self.c0(self.stem(x))))


def make_cheby():
    torch.manual_seed(0)
    return ChebyKAN()


def pykan_loss(out, y, model):
    """MSE plus pykan's regulariser, inside the loss the recorder is given."""
    return F.mse_loss(out, y) + 1e-2 * pykan_reg(model)


def make_gels_kan():
    """The layers refit with ``gels`` (QR, full rank assumed: the one driver torch has on CUDA)."""
    torch.manual_seed(0)
    model = KAN()
    for layer in model.layers:
        layer.driver = "gels"
    return model
