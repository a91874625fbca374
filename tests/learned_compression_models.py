"""Learned image compression written the way CompressAI writes it (InterDigitalInc/CompressAI:
``compressai/layers/gdn.py``, ``compressai/ops/parametrizers.py``, ``compressai/ops/bound_ops.py``,
``compressai/entropy_models/entropy_models.py``, ``compressai/models/google.py`` and
``examples/train.py``): GDN / inverse GDN with beta and gamma reparameterized through a
``NonNegativeParametrizer`` (``x ** 2 - pedestal`` after a ``LowerBound``), the factorized
``EntropyBottleneck`` (cumulative logits through ``softplus(matrix)`` and ``tanh(factor)``), the
``GaussianConditional`` of the scale hyperprior (Balle et al. 2018) and of the mean-scale model
(Minnen et al. 2018), additive uniform noise in training, the rate-distortion loss
``lmbda * 255 ** 2 * MSE + bpp`` returned as CompressAI's dict, and the quantiles' auxiliary
loss. Each planted bug is one a re-implementation forgot: a bound (``scale_bound=None``,
``likelihood_bound=0``) or GDN's reparameterization (``reparam=False``). The factories of
``test_learned_compression.py``."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

N, M, SIDE, BATCH = 4, 6, 16, 4


class LowerBoundFunction(torch.autograd.Function):
    """``max(x, bound)`` whose gradient passes where it pulls ``x`` up (compressai.ops)."""

    @staticmethod
    def forward(ctx, input_, bound):
        ctx.save_for_backward(input_, bound)
        return torch.max(input_, bound)

    @staticmethod
    def backward(ctx, grad_output):
        input_, bound = ctx.saved_tensors
        pass_through_if = (input_ >= bound) | (grad_output < 0)
        return pass_through_if * grad_output, None


class LowerBound(nn.Module):
    def __init__(self, bound: float):
        super().__init__()
        self.register_buffer("bound", torch.Tensor([float(bound)]))

    def forward(self, x):
        return LowerBoundFunction.apply(x, self.bound)


class NonNegativeParametrizer(nn.Module):
    """``x ** 2 - pedestal``, ``x`` bounded below first so the value stays >= ``minimum``."""

    def __init__(self, minimum: float = 0.0, reparam_offset: float = 2 ** -18):
        super().__init__()
        self.pedestal = reparam_offset ** 2
        self.register_buffer("pedestal_t", torch.Tensor([self.pedestal]))
        self.lower_bound = LowerBound((minimum + self.pedestal) ** 0.5)

    def init(self, x):
        return torch.sqrt(torch.max(x + self.pedestal, self.pedestal_t))

    def forward(self, x):
        out = self.lower_bound(x)
        return out ** 2 - self.pedestal


class GDN(nn.Module):
    """``y[i] = x[i] / sqrt(beta[i] + sum_j(gamma[j, i] * x[j] ** 2))`` (Balle 2016).
    ``reparam=False`` is the re-implementation that learns beta and gamma as they are (no
    ``NonNegativeParametrizer``): nothing keeps gamma's entries, or beta, non-negative."""

    def __init__(self, in_channels: int, inverse: bool = False, beta_min: float = 1e-6,
                 gamma_init: float = 0.1, reparam: bool = True):
        super().__init__()
        self.inverse = bool(inverse)
        self.beta_reparam = NonNegativeParametrizer(minimum=beta_min) if reparam else None
        self.gamma_reparam = NonNegativeParametrizer() if reparam else None
        beta = torch.ones(in_channels)
        gamma = gamma_init * torch.eye(in_channels)
        self.beta = nn.Parameter(self.beta_reparam.init(beta) if reparam else beta)
        self.gamma = nn.Parameter(self.gamma_reparam.init(gamma) if reparam else gamma)

    def forward(self, x):
        _, C, _, _ = x.size()
        beta, gamma = self.beta, self.gamma
        if self.beta_reparam is not None:
            beta = self.beta_reparam(beta)
            gamma = self.gamma_reparam(gamma)
        gamma = gamma.reshape(C, C, 1, 1)
        norm = F.conv2d(x ** 2, gamma, beta)
        if self.inverse:
            norm = torch.sqrt(norm)
        else:
            norm = torch.rsqrt(norm)
        return x * norm


def conv(cin, cout, k=5, s=2):
    return nn.Conv2d(cin, cout, k, stride=s, padding=k // 2)


def deconv(cin, cout, k=5, s=2):
    return nn.ConvTranspose2d(cin, cout, k, stride=s, output_padding=s - 1, padding=k // 2)


class EntropyBottleneck(nn.Module):
    """The fully factorized prior (Balle 2018, appendix 6.1), as compressai writes it."""

    def __init__(self, channels: int, tail_mass: float = 1e-9, init_scale: float = 10.0,
                 filters=(3, 3, 3, 3), likelihood_bound: float = 1e-9):
        super().__init__()
        self.channels = int(channels)
        self.filters = tuple(int(f) for f in filters)
        self.tail_mass = float(tail_mass)
        self.use_likelihood_bound = likelihood_bound > 0
        if self.use_likelihood_bound:
            self.likelihood_lower_bound = LowerBound(likelihood_bound)
        filters = (1,) + self.filters + (1,)
        scale = init_scale ** (1 / (len(self.filters) + 1))
        self.matrices, self.biases, self.factors = (nn.ParameterList() for _ in range(3))
        for i in range(len(self.filters) + 1):
            init = math.log(math.expm1(1 / scale / filters[i + 1]))
            self.matrices.append(nn.Parameter(
                torch.full((channels, filters[i + 1], filters[i]), init)))
            self.biases.append(nn.Parameter(
                torch.rand(channels, filters[i + 1], 1) - 0.5))
            if i < len(self.filters):
                self.factors.append(nn.Parameter(torch.zeros(channels, filters[i + 1], 1)))
        init = torch.Tensor([-init_scale, 0, init_scale])
        self.quantiles = nn.Parameter(init.repeat(channels, 1, 1))
        target = math.log(2 / self.tail_mass - 1)
        self.register_buffer("target", torch.Tensor([-target, 0, target]))

    def _logits_cumulative(self, inputs, stop_gradient: bool):
        logits = inputs
        for i in range(len(self.filters) + 1):
            matrix = self.matrices[i]
            if stop_gradient:
                matrix = matrix.detach()
            logits = torch.matmul(F.softplus(matrix), logits)
            bias = self.biases[i]
            if stop_gradient:
                bias = bias.detach()
            logits = logits + bias
            if i < len(self.factors):
                factor = self.factors[i]
                if stop_gradient:
                    factor = factor.detach()
                logits = logits + torch.tanh(factor) * torch.tanh(logits)
        return logits

    def _likelihood(self, inputs):
        half = 0.5
        lower = self._logits_cumulative(inputs - half, stop_gradient=False)
        upper = self._logits_cumulative(inputs + half, stop_gradient=False)
        sign = -torch.sign(lower + upper).detach()
        return torch.abs(torch.sigmoid(sign * upper) - torch.sigmoid(sign * lower))

    def loss(self):
        logits = self._logits_cumulative(self.quantiles, stop_gradient=True)
        return torch.abs(logits - self.target).sum()

    def forward(self, x):
        perm = (1, 0, 2, 3)
        x = x.permute(*perm).contiguous()
        shape = x.size()
        values = x.reshape(x.size(0), 1, -1)
        if self.training:
            half = 0.5
            values = values + torch.empty_like(values).uniform_(-half, half)
        else:
            values = torch.round(values)
        likelihood = self._likelihood(values)
        if self.use_likelihood_bound:
            likelihood = self.likelihood_lower_bound(likelihood)
        outputs = values.reshape(shape).permute(*perm).contiguous()
        likelihood = likelihood.reshape(shape).permute(*perm).contiguous()
        return outputs, likelihood


class GaussianConditional(nn.Module):
    """A Gaussian of the scales (and means) the hyper-synthesis predicts, as compressai writes
    it; ``scale_bound=None`` is the bug: the scales a ReLU made are divided by unbounded."""

    def __init__(self, scale_bound: float | None = 0.11, likelihood_bound: float = 1e-9):
        super().__init__()
        self.lower_bound_scale = LowerBound(scale_bound) if scale_bound is not None else None
        self.use_likelihood_bound = likelihood_bound > 0
        if self.use_likelihood_bound:
            self.likelihood_lower_bound = LowerBound(likelihood_bound)

    def _standardized_cumulative(self, inputs):
        half = 0.5
        const = -(2 ** -0.5)
        return half * torch.erfc(const * inputs)

    def _likelihood(self, inputs, scales, means=None):
        half = 0.5
        values = inputs - means if means is not None else inputs
        if self.lower_bound_scale is not None:
            scales = self.lower_bound_scale(scales)
        values = torch.abs(values)
        upper = self._standardized_cumulative((half - values) / scales)
        lower = self._standardized_cumulative((-half - values) / scales)
        return upper - lower

    def forward(self, inputs, scales, means=None):
        if self.training:
            outputs = inputs + torch.empty_like(inputs).uniform_(-0.5, 0.5)
        else:
            outputs = torch.round(inputs - means) + means if means is not None \
                else torch.round(inputs)
        likelihood = self._likelihood(outputs, scales, means)
        if self.use_likelihood_bound:
            likelihood = self.likelihood_lower_bound(likelihood)
        return outputs, likelihood


class ScaleHyperprior(nn.Module):
    """Balle et al. 2018 (compressai.models.ScaleHyperprior), a few channels wide."""

    def __init__(self, gdn_reparam=True, scale_bound=0.11, z_likelihood_bound=1e-9,
                 y_likelihood_bound=1e-9):
        super().__init__()
        self.g_a = nn.Sequential(conv(3, N), GDN(N, reparam=gdn_reparam),
                                 conv(N, M))
        self.g_s = nn.Sequential(deconv(M, N), GDN(N, inverse=True, reparam=gdn_reparam),
                                 deconv(N, 3))
        self.h_a = nn.Sequential(conv(M, N, 3, 1), nn.ReLU(inplace=True), conv(N, N))
        self.h_s = nn.Sequential(deconv(N, N), nn.ReLU(inplace=True), conv(N, M, 3, 1),
                                 nn.ReLU(inplace=True))
        self.entropy_bottleneck = EntropyBottleneck(N, likelihood_bound=z_likelihood_bound)
        self.gaussian_conditional = GaussianConditional(scale_bound, y_likelihood_bound)

    def aux_loss(self):
        return sum(m.loss() for m in self.modules() if isinstance(m, EntropyBottleneck))

    def forward(self, x):
        y = self.g_a(x)
        z = self.h_a(torch.abs(y))
        z_hat, z_likelihoods = self.entropy_bottleneck(z)
        scales_hat = self.h_s(z_hat)
        y_hat, y_likelihoods = self.gaussian_conditional(y, scales_hat)
        x_hat = self.g_s(y_hat)
        return {"x_hat": x_hat, "likelihoods": {"y": y_likelihoods, "z": z_likelihoods}}


class MeanScaleHyperprior(ScaleHyperprior):
    """Minnen et al. 2018 without the context model: h_s predicts scales and means."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.h_s = nn.Sequential(deconv(N, N), nn.LeakyReLU(inplace=True),
                                 conv(N, 2 * M, 3, 1))

    def forward(self, x):
        y = self.g_a(x)
        z = self.h_a(y)
        z_hat, z_likelihoods = self.entropy_bottleneck(z)
        gaussian_params = self.h_s(z_hat)
        scales_hat, means_hat = gaussian_params.chunk(2, 1)
        y_hat, y_likelihoods = self.gaussian_conditional(y, scales_hat, means=means_hat)
        x_hat = self.g_s(y_hat)
        return {"x_hat": x_hat, "likelihoods": {"y": y_likelihoods, "z": z_likelihoods}}


class RateDistortionLoss(nn.Module):
    """Custom rate distortion loss with a Lagrangian parameter (compressai examples/train.py)."""

    def __init__(self, lmbda=1e-2):
        super().__init__()
        self.mse = nn.MSELoss()
        self.lmbda = lmbda

    def forward(self, output, target):
        N, _, H, W = target.size()
        out = {}
        num_pixels = N * H * W
        out["bpp_loss"] = sum(
            (torch.log(likelihoods).sum() / (-math.log(2) * num_pixels))
            for likelihoods in output["likelihoods"].values()
        )
        out["mse_loss"] = self.mse(output["x_hat"], target)
        out["loss"] = self.lmbda * 255 ** 2 * out["mse_loss"] + out["bpp_loss"]
        return out


def configure_optimizers(net, lr=1e-2, aux_lr=1e-3):
    """Separate optimizers for the main and the auxiliary (quantiles) parameters."""
    params_dict = dict(net.named_parameters())
    parameters = {n for n, p in params_dict.items() if not n.endswith(".quantiles")}
    aux_parameters = {n for n, p in params_dict.items() if n.endswith(".quantiles")}
    optimizer = torch.optim.Adam((params_dict[n] for n in sorted(parameters)), lr=lr)
    aux_optimizer = torch.optim.Adam((params_dict[n] for n in sorted(aux_parameters)),
                                     lr=aux_lr)
    return optimizer, aux_optimizer


def images(n: int, seed: int = 0) -> torch.Tensor:
    """``n`` smooth random RGB crops in [0, 1] (the ImageFolder + ToTensor of train.py)."""
    g = torch.Generator().manual_seed(seed)
    low = torch.rand(n, 3, SIDE // 4, SIDE // 4, generator=g)
    return F.interpolate(low, size=(SIDE, SIDE), mode="bilinear", align_corners=False)


def make_hyperprior():
    torch.manual_seed(0)
    return ScaleHyperprior()


def make_hyperprior_no_scale_bound():
    torch.manual_seed(0)
    return ScaleHyperprior(scale_bound=None)


def make_hyperprior_no_z_bound():
    torch.manual_seed(0)
    return ScaleHyperprior(z_likelihood_bound=0)


def make_hyperprior_raw_gdn():
    torch.manual_seed(0)
    return ScaleHyperprior(gdn_reparam=False)


def make_mean_scale():
    torch.manual_seed(0)
    return MeanScaleHyperprior()


def make_mean_scale_no_scale_bound():
    torch.manual_seed(0)
    return MeanScaleHyperprior(scale_bound=None)


def make_mean_scale_unbounded():
    torch.manual_seed(0)
    return MeanScaleHyperprior(scale_bound=None, y_likelihood_bound=0)


def make_hyperprior_no_likelihood_bound():
    torch.manual_seed(0)
    return ScaleHyperprior(y_likelihood_bound=0, z_likelihood_bound=0)
