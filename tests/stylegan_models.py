"""StyleGAN2-ADA as NVlabs/stylegan2-ada-pytorch writes it, shrunk to 8x8 images.

- ``FullyConnectedLayer``/``Conv2dLayer``: equalized learning rate, weights stored as
  ``randn / lr_multiplier`` and scaled at runtime by ``lr_multiplier / sqrt(fan_in)``.
- ``MappingNetwork``: ``normalize_2nd_moment`` of z, 2 layers with ``lr_multiplier=0.01``,
  ``w_avg`` tracked in a buffer, ``ws`` broadcast over the layers.
- ``modulated_conv2d``: ``w * styles``, demodulation ``(w ** 2).sum([2,3,4]) + 1e-8).rsqrt()``
  and the grouped convolution; ``SynthesisLayer`` adds per-pixel noise (a ``noise_const``
  buffer and a learned ``noise_strength``); ``ToRGBLayer`` modulates without demodulation.
- ``StyleGAN2Loss.accumulate_gradients``-style phases (Gmain, Greg, Dmain, Dreg) live in the
  test's loop: the non-saturating logistic loss ``softplus(-D(G(z)))``, the lazy R1 and path
  length regularizers.

The factories of ``test_stylegan.py``.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

Z_DIM = W_DIM = 16
RES = 8
NUM_WS = 4  # b4.conv1, b4.torgb, b8.conv0 + b8.conv1, b8.torgb share indices as in ADA


def normalize_2nd_moment(x, dim=1, eps=1e-8):
    return x * (x.square().mean(dim=dim, keepdim=True) + eps).rsqrt()


class FullyConnectedLayer(nn.Module):
    def __init__(self, in_features, out_features, bias=True, activation="linear",
                 lr_multiplier=1, bias_init=0):
        super().__init__()
        self.activation = activation
        self.weight = nn.Parameter(torch.randn([out_features, in_features]) / lr_multiplier)
        self.bias = nn.Parameter(torch.full([out_features], np.float32(bias_init))) if bias \
            else None
        self.weight_gain = lr_multiplier / np.sqrt(in_features)
        self.bias_gain = lr_multiplier

    def forward(self, x):
        w = self.weight * self.weight_gain
        b = self.bias * self.bias_gain
        x = torch.addmm(b.unsqueeze(0), x, w.t())
        if self.activation == "lrelu":
            x = F.leaky_relu(x, 0.2) * np.sqrt(2)
        return x


class MappingNetwork(nn.Module):
    def __init__(self, num_layers=2, w_avg_beta=0.995):
        super().__init__()
        self.w_avg_beta = w_avg_beta
        for idx in range(num_layers):
            setattr(self, f"fc{idx}", FullyConnectedLayer(
                Z_DIM if idx == 0 else W_DIM, W_DIM, activation="lrelu", lr_multiplier=0.01))
        self.num_layers = num_layers
        self.register_buffer("w_avg", torch.zeros([W_DIM]))

    def forward(self, z, truncation_psi=1, skip_w_avg_update=False):
        x = normalize_2nd_moment(z)
        for idx in range(self.num_layers):
            x = getattr(self, f"fc{idx}")(x)
        if self.training and not skip_w_avg_update:
            self.w_avg.copy_(x.detach().mean(dim=0).lerp(self.w_avg, self.w_avg_beta))
        x = x.unsqueeze(1).repeat([1, NUM_WS, 1])
        if truncation_psi != 1:
            x = self.w_avg.lerp(x, truncation_psi)
        return x


def modulated_conv2d(x, weight, styles, noise=None, padding=0, demodulate=True, demod_eps=1e-8):
    batch_size = x.shape[0]
    out_channels, in_channels, kh, kw = weight.shape
    w = weight.unsqueeze(0)  # [NOIkk]
    w = w * styles.reshape(batch_size, 1, -1, 1, 1)  # [NOIkk]
    if demodulate:
        dcoefs = (w.square().sum(dim=[2, 3, 4]) + demod_eps).rsqrt()  # [NO]
        w = w * dcoefs.reshape(batch_size, -1, 1, 1, 1)  # [NOIkk]
    x = x.reshape(1, -1, *x.shape[2:])
    w = w.reshape(-1, in_channels, kh, kw)
    x = F.conv2d(x, w, padding=padding, groups=batch_size)
    x = x.reshape(batch_size, -1, *x.shape[2:])
    if noise is not None:
        x = x.add_(noise)
    return x


class SynthesisLayer(nn.Module):
    def __init__(self, in_channels, out_channels, resolution, up=1, demod_eps=1e-8,
                 affine_bias_init=1):
        super().__init__()
        self.resolution, self.up, self.demod_eps = resolution, up, demod_eps
        self.affine = FullyConnectedLayer(W_DIM, in_channels, bias_init=affine_bias_init)
        self.weight = nn.Parameter(torch.randn([out_channels, in_channels, 3, 3]))
        self.bias = nn.Parameter(torch.zeros([out_channels]))
        self.register_buffer("noise_const", torch.randn([resolution, resolution]))
        self.noise_strength = nn.Parameter(torch.zeros([]))

    def forward(self, x, w, noise_mode="random"):
        if self.up > 1:
            x = F.interpolate(x, scale_factor=self.up, mode="nearest")
        styles = self.affine(w)
        noise = None
        if noise_mode == "random":
            noise = torch.randn([x.shape[0], 1, self.resolution, self.resolution]) * \
                self.noise_strength
        elif noise_mode == "const":
            noise = self.noise_const * self.noise_strength
        x = modulated_conv2d(x, self.weight, styles, noise=noise, padding=1,
                             demod_eps=self.demod_eps)
        return F.leaky_relu(x + self.bias.reshape(1, -1, 1, 1), 0.2) * np.sqrt(2)


class ToRGBLayer(nn.Module):
    def __init__(self, in_channels, conv_clamp=None):
        super().__init__()
        self.conv_clamp = conv_clamp
        self.affine = FullyConnectedLayer(W_DIM, in_channels, bias_init=1)
        self.weight = nn.Parameter(torch.randn([3, in_channels, 1, 1]))
        self.bias = nn.Parameter(torch.zeros([3]))
        self.weight_gain = 1 / np.sqrt(in_channels)

    def forward(self, x, w):
        styles = self.affine(w) * self.weight_gain
        x = modulated_conv2d(x, self.weight, styles, demodulate=False)
        x = x + self.bias.reshape(1, -1, 1, 1)
        if self.conv_clamp is not None:
            x = x.clamp(-self.conv_clamp, self.conv_clamp)
        return x


class SynthesisNetwork(nn.Module):
    def __init__(self, channels=8, demod_eps=1e-8, affine_bias_init=1, conv_clamp=None):
        super().__init__()
        self.const = nn.Parameter(torch.randn([channels, 4, 4]))
        kw = dict(demod_eps=demod_eps, affine_bias_init=affine_bias_init)
        self.b4_conv1 = SynthesisLayer(channels, channels, 4, **kw)
        self.b4_torgb = ToRGBLayer(channels, conv_clamp)
        self.b8_conv0 = SynthesisLayer(channels, channels, 8, up=2, **kw)
        self.b8_conv1 = SynthesisLayer(channels, channels, 8, **kw)
        self.b8_torgb = ToRGBLayer(channels, conv_clamp)

    def forward(self, ws, noise_mode="random"):
        x = self.const.unsqueeze(0).repeat([ws.shape[0], 1, 1, 1])
        x = self.b4_conv1(x, ws[:, 0], noise_mode)
        img = self.b4_torgb(x, ws[:, 1])
        x = self.b8_conv0(x, ws[:, 1], noise_mode)
        x = self.b8_conv1(x, ws[:, 2], noise_mode)
        img = F.interpolate(img, scale_factor=2, mode="nearest")
        return img + self.b8_torgb(x, ws[:, 3])


class Generator(nn.Module):
    def __init__(self, **synthesis_kwargs):
        super().__init__()
        self.mapping = MappingNetwork()
        self.synthesis = SynthesisNetwork(**synthesis_kwargs)

    def forward(self, z, z2=None, mixing_cutoff=None, noise_mode="random",
                return_latents=False):
        ws = self.mapping(z)
        if z2 is not None:  # style mixing: the layers from the cutoff on take the 2nd w
            ws = ws.clone()
            ws[:, mixing_cutoff:] = self.mapping(z2, skip_w_avg_update=True)[:, mixing_cutoff:]
        img = self.synthesis(ws, noise_mode=noise_mode)
        return (img, ws) if return_latents else img


class Conv2dLayer(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, activation="lrelu", down=1):
        super().__init__()
        self.activation, self.down, self.padding = activation, down, kernel_size // 2
        self.weight = nn.Parameter(torch.randn([out_channels, in_channels, kernel_size,
                                                kernel_size]))
        self.bias = nn.Parameter(torch.zeros([out_channels]))
        self.weight_gain = 1 / np.sqrt(in_channels * kernel_size ** 2)

    def forward(self, x):
        x = F.conv2d(x, self.weight * self.weight_gain, self.bias, padding=self.padding)
        if self.down > 1:
            x = F.avg_pool2d(x, self.down)
        if self.activation == "lrelu":
            x = F.leaky_relu(x, 0.2) * np.sqrt(2)
        return x


class Discriminator(nn.Module):
    def __init__(self, channels=8):
        super().__init__()
        self.fromrgb = Conv2dLayer(3, channels, 1)
        self.b8_conv0 = Conv2dLayer(channels, channels, 3)
        self.b8_conv1 = Conv2dLayer(channels, channels, 3, down=2)
        self.fc = FullyConnectedLayer(channels * 16, channels, activation="lrelu")
        self.out = FullyConnectedLayer(channels, 1)

    def forward(self, img):
        x = self.b8_conv1(self.b8_conv0(self.fromrgb(img)))
        return self.out(self.fc(x.flatten(1)))


def make_generator():
    torch.manual_seed(0)
    return Generator()


def make_generator_no_eps():
    """The demodulation without its eps and the styles' bias started at 0 (a port that
    followed the paper's ``sum(w ** 2)`` and a bias_init left at its default)."""
    torch.manual_seed(0)
    return Generator(demod_eps=0.0, affine_bias_init=0)


def make_discriminator():
    torch.manual_seed(1)
    return Discriminator()


def real_images(step: int, n: int = 8) -> torch.Tensor:
    """A fixed 'dataset' of smooth blobs in [-1, 1], one batch per step."""
    g = torch.Generator().manual_seed(1000 + step)
    base = torch.randn(n, 3, 4, 4, generator=g)
    return F.interpolate(base, scale_factor=2, mode="bilinear").tanh()


def make_generator_clamp0():
    """``conv_clamp=0`` meant as 'no clamp' (ADA's ``--cbase``-style option whose off value
    is None): every ToRGB output is clamped to [0, 0]."""
    torch.manual_seed(0)
    return Generator(conv_clamp=0)


def augment(img, p: float, gen: torch.Generator):
    """ADA's pipeline, cut to its pixel blitting: xflip and an integer translation, each
    applied to a sample with probability ``p`` (drawn from the loop's own generator)."""
    n = img.shape[0]
    flip = torch.rand(n, 1, 1, 1, generator=gen) < p
    img = torch.where(flip, img.flip(3), img)
    shift = torch.rand(n, 1, 1, 1, generator=gen) < p
    return torch.where(shift, img.roll(1, dims=2), img)
