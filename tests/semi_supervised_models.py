"""Semi-supervised classifiers written the way FixMatch, MixMatch, ReMixMatch/USB, UDA and
Mean Teacher implementations write them, for ``test_semi_supervised``.

- ``WRN``: a small wide-ResNet (conv, BatchNorm with momentum 0.001, LeakyReLU 0.1, one
  residual block, global pooling, a linear head), run on FixMatch's interleaved batch of the
  labelled, weak and strong views so BatchNorm sees all three.
- ``DistAlignLoss``: FixMatch with ReMixMatch's distribution alignment, ``p * p_target /
  p_model`` renormalised, ``p_model`` a running mean kept in a buffer of the loss; the
  strong view's cross-entropy to the aligned distribution (soft pseudo-labels) on the
  confident rows, averaged by ``mask.mean()``. ``p_model`` is either the running
  mean of the probabilities (USB's ``DistAlignEMAHook``) or of the pseudo-label histogram
  (the bug: a class never predicted keeps a running mean of exactly 0).
- ``uda_loss``: UDA's sharpened KL consistency, the weak view's logits divided by the softmax
  temperature (the bug: a temperature of 0 meant as "no sharpening").
- ``sharpen``: MixMatch's ``p ** (1 / T)`` renormalised, called by the loop under
  ``torch.no_grad`` on the averaged guesses of K augmentations; ``mixmatch_loss`` its
  mixed-up cross-entropy and MSE terms.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

CLASSES, SIDE = 4, 8


class Block(nn.Module):
    def __init__(self, ch: int):
        super().__init__()
        self.bn1, self.conv1 = nn.BatchNorm2d(ch, momentum=0.001), nn.Conv2d(ch, ch, 3, 1, 1)
        self.bn2, self.conv2 = nn.BatchNorm2d(ch, momentum=0.001), nn.Conv2d(ch, ch, 3, 1, 1)

    def forward(self, x):
        out = self.conv1(F.leaky_relu(self.bn1(x), 0.1))
        return x + self.conv2(F.leaky_relu(self.bn2(out), 0.1))


class WRN(nn.Module):
    def __init__(self, ch: int = 8):
        super().__init__()
        self.stem = nn.Conv2d(3, ch, 3, 1, 1)
        self.block = Block(ch)
        self.bn = nn.BatchNorm2d(ch, momentum=0.001)
        self.fc = nn.Linear(ch, CLASSES)

    def forward(self, x):
        out = F.leaky_relu(self.bn(self.block(self.stem(x))), 0.1)
        return self.fc(F.adaptive_avg_pool2d(out, 1).flatten(1))


def make_wrn() -> WRN:
    torch.manual_seed(0)
    return WRN()


def interleave(x, size: int):
    s = list(x.shape)
    return x.reshape([-1, size] + s[1:]).transpose(0, 1).reshape([-1] + s[1:])


def de_interleave(x, size: int):
    s = list(x.shape)
    return x.reshape([size, -1] + s[1:]).transpose(0, 1).reshape([-1] + s[1:])


# ---------------------------------------------------------------------------------------------
# data and augmentations


def weak(x, g: torch.Generator):
    """Random horizontal flip and a 1-pixel translation (FixMatch's weak augmentation)."""
    flip = torch.rand(x.shape[0], generator=g) < 0.5
    x = torch.where(flip[:, None, None, None], x.flip(-1), x)
    dx, dy = (int(v) for v in torch.randint(-1, 2, (2,), generator=g))
    return torch.roll(x, (dy, dx), (-2, -1))


def autocontrast(x):
    """PIL's AutoContrast on the batch: each image's channels stretched to [0, 1]."""
    lo = x.amin((2, 3), keepdim=True)
    hi = x.amax((2, 3), keepdim=True)
    return (x - lo) / (hi - lo)  # the bug: a constant channel (a blank frame) is 0/0


def strong(x, g: torch.Generator, contrast: bool = False):
    """The weak view plus RandAugment-like contrast (or AutoContrast) and Cutout of a 3x3
    patch."""
    x = weak(x, g)
    c = 0.5 + torch.rand(x.shape[0], 1, 1, 1, generator=g)
    x = (x - x.mean((1, 2, 3), keepdim=True)) * c + x.mean((1, 2, 3), keepdim=True)
    if contrast:
        x = autocontrast(x)
    i, j = (int(v) for v in torch.randint(0, SIDE - 3, (2,), generator=g))
    x = x.clone()
    x[:, :, i:i + 3, j:j + 3] = 0.5
    return x


def images(g: torch.Generator, n: int):
    """Class-coloured blobs on noise: class c brightens channel c % 3 (and 3 inverts it)."""
    y = torch.randint(0, CLASSES, (n,), generator=g)
    x = 0.3 * torch.rand(n, 3, SIDE, SIDE, generator=g)
    for i, c in enumerate(y.tolist()):
        x[i, c % 3, 2:6, 2:6] += 0.6 if c < 3 else -0.3
    return x, y


# ---------------------------------------------------------------------------------------------
# losses


class DistAlignLoss(nn.Module):
    """FixMatch + distribution alignment: the weak view's probabilities times the labelled
    class prior over ``p_model``, renormalised, then thresholded into pseudo-labels."""

    def __init__(self, threshold: float = 0.7, momentum: float = 0.999, hard: bool = False):
        super().__init__()
        self.threshold, self.momentum, self.hard = threshold, momentum, hard
        self.register_buffer("p_target", torch.full((CLASSES,), 1 / CLASSES))
        init = torch.zeros(CLASSES) if hard else torch.full((CLASSES,), 1 / CLASSES)
        self.register_buffer("p_model", init)

    @torch.no_grad()
    def align(self, probs):
        seen = F.one_hot(probs.argmax(-1), CLASSES).float() if self.hard else probs
        if self.hard and not self.p_model.any():
            self.p_model.copy_(seen.mean(0))  # the bug: a class no row predicted stays at 0
        else:
            self.p_model.mul_(self.momentum).add_(seen.mean(0), alpha=1 - self.momentum)
        probs = probs * self.p_target / self.p_model
        return probs / probs.sum(-1, keepdim=True)

    def forward(self, logits_x, y, logits_w, logits_s):
        sup = F.cross_entropy(logits_x, y)
        probs = self.align(logits_w.detach().softmax(-1))
        mask = probs.max(-1).values.ge(self.threshold).float()
        # soft pseudo-labels (USB's use_hard_label=False): the aligned distribution itself
        unsup = (-(probs * F.log_softmax(logits_s, -1)).sum(-1) * mask).mean()
        return sup + unsup


def make_da_loss() -> DistAlignLoss:
    return DistAlignLoss()


def make_da_hist_loss() -> DistAlignLoss:
    return DistAlignLoss(hard=True)


class SoftMatchLoss(nn.Module):
    """SoftMatch: each unlabelled row weighted by a truncated Gaussian of its confidence,
    ``exp(-clamp(p - mu, max=0)^2 / (2 var / n_sigma^2))``, with the confidences' mean and
    variance kept as running estimates (EMA of each batch's ``mean()`` and ``var()``)."""

    def __init__(self, momentum: float = 0.999, n_sigma: float = 2.0):
        super().__init__()
        self.momentum, self.n_sigma = momentum, n_sigma
        self.register_buffer("mu", torch.tensor(1 / CLASSES))
        self.register_buffer("var", torch.tensor(1.0))

    def forward(self, logits_x, y, logits_w, logits_s):
        sup = F.cross_entropy(logits_x, y)
        with torch.no_grad():
            conf, pseudo = logits_w.softmax(-1).max(-1)
            m = self.momentum
            self.mu.mul_(m).add_(conf.mean(), alpha=1 - m)
            self.var.mul_(m).add_(conf.var(unbiased=True), alpha=1 - m)  # the bug: 1 row
            mask = torch.exp(-(torch.clamp(conf - self.mu, max=0.0) ** 2)
                             / (2 * self.var / self.n_sigma ** 2))
        return sup + (F.cross_entropy(logits_s, pseudo, reduction="none") * mask).mean()


def make_softmatch_loss() -> SoftMatchLoss:
    return SoftMatchLoss()


def uda_loss(logits_x, y, logits_w, logits_s, temperature: float = 0.4,
             threshold: float = 0.8):
    """UDA: CE on the labelled rows plus the KL of the strong view to the sharpened weak view,
    on the rows whose confidence passes the threshold, averaged over all rows."""
    sup = F.cross_entropy(logits_x, y)
    with torch.no_grad():
        probs = torch.softmax(logits_w / temperature, -1)  # the bug: temperature 0
        mask = logits_w.softmax(-1).max(-1).values.ge(threshold).float()
    kl = (probs * (torch.log(probs + 1e-8) - F.log_softmax(logits_s, -1))).sum(-1)
    return sup + (kl * mask).mean()


def sharpen(p, T: float):
    pt = p ** (1 / T)  # the bug: a tiny T underflows every class of an unsure row to 0
    return pt / pt.sum(dim=1, keepdim=True)


def mixmatch_loss(logits_x, targets_x, logits_u, targets_u, lambda_u: float = 75.0):
    """MixMatch's semi-supervised loss: soft cross-entropy on the mixed labelled rows, MSE of
    the mixed unlabelled rows' softmax to their mixed guesses."""
    lx = -torch.mean(torch.sum(F.log_softmax(logits_x, dim=1) * targets_x, dim=1))
    lu = torch.mean((torch.softmax(logits_u, dim=1) - targets_u) ** 2)
    return lx + lambda_u * lu
