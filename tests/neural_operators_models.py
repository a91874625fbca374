"""Neural operators for PDEs as the neuraloperator / PINO / DeepONet code writes them, for
``test_neural_operators``.

- ``FNO2d``: a Fourier Neural Operator on a 16 x 16 grid (Darcy flow ``a(x) -> u(x)``): the
  input channels plus the grid lifted by a ``Linear``, Fourier layers of ``SpectralConv2d``
  (``rfftn``, complex ``cfloat`` weights on the lowest modes, the rest truncated, ``irfftn``)
  beside a 1 x 1 ``Conv2d``, GELU, and a projection ``Linear``. An optional
  ``UnitGaussianNormalizer`` (per grid point mean and std fitted on the training set, with
  ``eps``) encodes the inputs in ``forward``; an optional ``FieldNorm`` standardises each
  sample's field by its one-pass variance ``E[x^2] - E[x]^2``.
- ``DeepONet``: branch MLP over the input function at fixed sensors, trunk over the query
  coordinates ``(B, P, 2)``, their dot product plus a bias; the trunk's features are normalised
  Gaussian radial basis functions around learned centres.
- ``rel_l2``: neuraloperator's ``LpLoss``, ``||u_pred - u|| / ||u||`` per sample, averaged.
- ``PINOLoss``: the data term plus a physics term from central finite differences of the
  (non-negative) output: a total-variation penalty ``sqrt(u_x^2 + u_y^2 + eps)``.
- ``darcy_batch`` / ``DarcyData``: piecewise-constant coefficient fields and a smoothed
  solution-like target with ``u = 0`` on the boundary, and the planted data conditions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

S, MODES, WIDTH = 16, 4, 8


class UnitGaussianNormalizer(nn.Module):
    """Per grid point mean and std of the training set, ``(x - mean) / (std + eps)``."""

    def __init__(self, x: torch.Tensor, eps: float = 1e-5):
        super().__init__()
        self.register_buffer("mean", x.mean(0))
        self.register_buffer("std", x.std(0))
        self.eps = eps

    def forward(self, x):
        return (x - self.mean) / (self.std + self.eps)


class FieldNorm(nn.Module):
    """Each sample's field standardised by its one-pass variance (no eps)."""

    def forward(self, x):
        mean = x.mean((1, 2), keepdim=True)
        var = (x * x).mean((1, 2), keepdim=True) - mean * mean
        return (x - mean) / torch.sqrt(var)


class SpectralConv2d(nn.Module):
    """The FNO's Fourier layer: ``irfftn(W * rfftn(x)[lowest modes])``."""

    def __init__(self, cin: int, cout: int, modes: int):
        super().__init__()
        self.cout, self.modes = cout, modes
        scale = 1 / (cin * cout)
        self.weights1 = nn.Parameter(scale * torch.rand(cin, cout, modes, modes,
                                                        dtype=torch.cfloat))
        self.weights2 = nn.Parameter(scale * torch.rand(cin, cout, modes, modes,
                                                        dtype=torch.cfloat))

    def forward(self, x):
        b, _, h, w = x.shape
        m = self.modes
        x_ft = torch.fft.rfftn(x.float(), dim=(-2, -1))
        out_ft = torch.zeros(b, self.cout, h, w // 2 + 1, dtype=torch.cfloat, device=x.device)
        out_ft[:, :, :m, :m] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, :m, :m], self.weights1)
        out_ft[:, :, -m:, :m] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, -m:, :m],
                                             self.weights2)
        return torch.fft.irfftn(out_ft, s=(h, w), dim=(-2, -1)).to(x.dtype)


class FNO2d(nn.Module):
    """``x (B, S, S, C) -> u (B, S, S)``."""

    def __init__(self, channels: int = 1, normalizer: UnitGaussianNormalizer | None = None,
                 field_norm: bool = False, positive: bool = False, layers: int = 2):
        super().__init__()
        self.normalizer = normalizer
        self.field_norm = FieldNorm() if field_norm else None
        self.lift = nn.Linear(channels + 2, WIDTH)
        self.spectral = nn.ModuleList(SpectralConv2d(WIDTH, WIDTH, MODES) for _ in range(layers))
        self.pointwise = nn.ModuleList(nn.Conv2d(WIDTH, WIDTH, 1) for _ in range(layers))
        self.proj1 = nn.Linear(WIDTH, 32)
        self.proj2 = nn.Linear(32, 1)
        self.positive = positive

    def forward(self, x):
        if self.normalizer is not None:
            x = self.normalizer(x)
        if self.field_norm is not None:
            x = self.field_norm(x)
        b, h, w, _ = x.shape
        gx = torch.linspace(0, 1, h, device=x.device, dtype=x.dtype).view(1, h, 1, 1).expand(b, h, w, 1)
        gy = torch.linspace(0, 1, w, device=x.device, dtype=x.dtype).view(1, 1, w, 1).expand(b, h, w, 1)
        x = self.lift(torch.cat([x, gx, gy], -1)).permute(0, 3, 1, 2)
        for i, (spec, conv) in enumerate(zip(self.spectral, self.pointwise)):
            x = spec(x) + conv(x)
            if i < len(self.spectral) - 1:
                x = F.gelu(x)
        u = self.proj2(F.gelu(self.proj1(x.permute(0, 2, 3, 1)))).squeeze(-1)
        return F.relu(u) if self.positive else u


def training_inputs(n: int = 64, forcing: bool = False, failed: int | None = None
                    ) -> torch.Tensor:
    """The training set's inputs, to fit the normaliser on (with a constant forcing f = 1;
    ``failed``: a sample whose file holds a NaN patch)."""
    g = torch.Generator().manual_seed(123)
    a = coefficient(n, g)
    if failed is not None:
        a[failed, 3:6, 3:6] = float("nan")
    return torch.stack([a, torch.ones_like(a)], -1) if forcing else a.unsqueeze(-1)


def make_fno() -> FNO2d:
    torch.manual_seed(0)
    return FNO2d()


def make_fno_normalised() -> FNO2d:
    """Inputs ``[a, f]`` encoded per grid point; ``f = 1`` everywhere, so its std is 0."""
    torch.manual_seed(0)
    return FNO2d(channels=2, normalizer=UnitGaussianNormalizer(training_inputs(forcing=True),
                                                               eps=0.0))


def make_fno_normalised_eps() -> FNO2d:
    torch.manual_seed(0)
    return FNO2d(channels=2, normalizer=UnitGaussianNormalizer(training_inputs(forcing=True)))


def make_fno_fitted_on_nan() -> FNO2d:
    """The normaliser fitted on a training set one of whose files holds a NaN patch."""
    torch.manual_seed(0)
    return FNO2d(normalizer=UnitGaussianNormalizer(training_inputs(failed=17)))


def make_fno_field_norm() -> FNO2d:
    torch.manual_seed(0)
    return FNO2d(field_norm=True)


def make_fno_positive() -> FNO2d:
    torch.manual_seed(0)
    return FNO2d(positive=True)


class DeepONet(nn.Module):
    """Branch over ``a`` at the sensors ``(B, M)``, trunk over queries ``y (B, P, 2)``."""

    def __init__(self, sensors: int = S * S, p: int = 16, width: float = 0.1):
        super().__init__()
        self.branch = nn.Sequential(nn.Linear(sensors, 32), nn.Tanh(), nn.Linear(32, p))
        self.centres = nn.Parameter(torch.rand(p, 2))
        self.width = width
        self.trunk = nn.Linear(p, p)
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, a, y):
        """``y``: each sample's queries ``(B, P, 2)``, or one query grid ``(P, 2)`` for all."""
        d2 = ((y.unsqueeze(-2) - self.centres) ** 2).sum(-1)
        phi = torch.exp(-d2 / (2 * self.width ** 2))
        phi = phi / phi.sum(-1, keepdim=True)  # normalised radial basis
        t = torch.tanh(self.trunk(phi))
        if t.dim() == 2:  # (one grid for every sample)
            return self.branch(a) @ t.T + self.bias
        return torch.einsum("bp,bqp->bq", self.branch(a), t) + self.bias


def make_deeponet() -> DeepONet:
    torch.manual_seed(0)
    return DeepONet()


def rel_l2(pred, y):
    """neuraloperator's ``LpLoss(p=2)``: the mean over samples of ``||pred - y|| / ||y||``."""
    b = pred.shape[0]
    diff = torch.norm(pred.reshape(b, -1) - y.reshape(b, -1), 2, 1)
    y_norm = torch.norm(y.reshape(b, -1), 2, 1)
    return (diff / y_norm).mean()


def rel_mse(pred, y):
    """The relative squared error per sample, ``sum (pred - y)^2 / sum y^2``, averaged."""
    b = pred.shape[0]
    err = ((pred - y) ** 2).reshape(b, -1).sum(1)
    return (err / (y ** 2).reshape(b, -1).sum(1)).mean()


class LpLoss:
    """neuraloperator's ``LpLoss``: a plain callable object (not an ``nn.Module``), the relative
    Lp error per sample, averaged or summed."""

    def __init__(self, d: int = 2, p: int = 2, size_average: bool = True,
                 reduction: bool = True):
        self.d, self.p, self.size_average, self.reduction = d, p, size_average, reduction

    def rel(self, x, y):
        num_examples = x.size()[0]
        diff_norms = torch.norm(x.reshape(num_examples, -1) - y.reshape(num_examples, -1),
                                self.p, 1)
        y_norms = torch.norm(y.reshape(num_examples, -1), self.p, 1)
        if self.reduction:
            if self.size_average:
                return torch.mean(diff_norms / y_norms)
            return torch.sum(diff_norms / y_norms)
        return diff_norms / y_norms

    def __call__(self, x, y):
        return self.rel(x, y)


class PINOLoss(nn.Module):
    """Data loss plus a total-variation physics term of the output's central differences."""

    def __init__(self, eps: float = 1e-8, weight: float = 0.1):
        super().__init__()
        self.eps, self.weight = eps, weight

    def forward(self, u, y):
        dx = 1.0 / (u.shape[-1] - 1)
        ux = (u[:, 2:, 1:-1] - u[:, :-2, 1:-1]) / (2 * dx)
        uy = (u[:, 1:-1, 2:] - u[:, 1:-1, :-2]) / (2 * dx)
        tv = torch.sqrt(ux ** 2 + uy ** 2 + self.eps).mean()
        return rel_l2(u, y) + self.weight * tv


def coefficient(n: int, g: torch.Generator) -> torch.Tensor:
    """Piecewise-constant permeability fields (3 or 12), as in the Darcy benchmark."""
    coarse = torch.rand(n, 1, 4, 4, generator=g)
    a = F.interpolate(coarse, size=(S, S), mode="nearest").squeeze(1)
    return torch.where(a > 0.5, 12.0, 3.0)


def solution(a: torch.Tensor) -> torch.Tensor:
    """A smooth solution-like field of ``a``: 0 on the boundary, larger where ``a`` is small."""
    k = torch.ones(1, 1, 5, 5) / 25
    u = F.conv2d((1 / a).unsqueeze(1), k, padding=2).squeeze(1)
    u[:, 0], u[:, -1], u[:, :, 0], u[:, :, -1] = 0, 0, 0, 0
    return u


def target_normalizer(eps: float = 1e-5) -> UnitGaussianNormalizer:
    """The per grid point normaliser of the training set's solutions, which are 0 on the
    boundary in every sample (std 0 there)."""
    return UnitGaussianNormalizer(solution(coefficient(64, torch.Generator().manual_seed(5))),
                                  eps=eps)


def make_fno_half() -> FNO2d:
    """The FNO cast to float16 for pure half-precision training (``model.half()``: the complex
    spectral weights stay ``cfloat``)."""
    return make_fno().half()


def darcy_batch(g: torch.Generator, b: int = 8, forcing: bool = False,
                zero_target: int | None = None, nan_input: int | None = None,
                offset: float = 0.0, far_query: int | None = None, deeponet: bool = False,
                shared_grid: bool = False):
    """One batch ``(x, u)`` (or ``(a, y, u)`` for the DeepONet) with a planted condition."""
    a = coefficient(b, g)
    u = solution(a)
    if zero_target is not None:  # a sample the solver wrote as all 0 (a failed solve)
        u[zero_target] = 0
    x = a.unsqueeze(-1) + offset
    if forcing:
        x = torch.cat([x, torch.ones_like(x)], -1)
    if nan_input is not None:  # a coefficient file with a NaN patch
        x[nan_input, 3:6, 3:6] = float("nan")
    if not deeponet:
        return x, u
    y = torch.rand(b, 32, 2, generator=g)
    if shared_grid:  # one grid of query points for the whole batch
        y = y[0]
    if far_query is not None:  # queries in grid units (0..15), not the unit square
        y[far_query] = y[far_query] * (S - 1)
    idx = (y * (S - 1)).round().long().clamp(0, S - 1)
    if shared_grid:
        return a.reshape(b, -1), y, u[:, idx[:, 0], idx[:, 1]]
    target = u[torch.arange(b)[:, None], idx[..., 0], idx[..., 1]]
    return a.reshape(b, -1), y, target


class Trajectories(torch.utils.data.Dataset):
    """Trajectories of a smoothing flow ``u_{t+1} = u_t + dt * lap(u_t)`` for rollout training;
    ``pascal`` holds one trajectory in Pa rather than the normalised units of the others."""

    def __init__(self, n: int = 16, steps: int = 4, pascal: int | None = None):
        g = torch.Generator().manual_seed(7)
        u = torch.randn(n, S, S, generator=g)
        traj = [u]
        for _ in range(steps):
            lap = (u.roll(1, 1) + u.roll(-1, 1) + u.roll(1, 2) + u.roll(-1, 2) - 4 * u)
            u = u + 0.1 * lap
            traj.append(u)
        self.traj = torch.stack(traj, 1)  # (n, steps + 1, S, S)
        if pascal is not None:
            self.traj[pascal] = self.traj[pascal] * 1e5 + 1e5

    def __len__(self):
        return len(self.traj)

    def __getitem__(self, i):
        return self.traj[i]
