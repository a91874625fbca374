"""Handwriting synthesis as Graves (2013) and its PyTorch ports write it: an LSTM over pen
offsets ``(dx, dy, pen_up)`` with teacher forcing, a soft attention window over the one-hot
characters of the line's transcription (K Gaussians whose positions ``kappa`` grow by ``exp``
increments), a second LSTM with skip connections, and a mixture density output layer: ``pi``
by softmax, ``mu``, ``sigma = exp(.)``, ``rho = tanh(.)`` and the end-of-stroke Bernoulli.
The loss is the masked negative log-likelihood of the bivariate Gaussian mixture over padded
stroke sequences. Derivatives are clipped inside the network as Graves did (LSTM outputs to
[-10, 10], the output layer's inputs to [-100, 100]) by gradient hooks the forward registers.

The planted bugs are the domain's own: the mixture density summed in probability space (log of
an underflowed 0), a per-line mean over an empty stroke file (0/0), a window normalised over a
transcription that lost all its characters (0/0) or run past one cut to a character (phi
underflowed), rho rounded to +-1 by tanh (float32, bfloat16, a MultivariateNormal's Cholesky
factor), a collapsed mixture's log(pi), padding holding stale memory under ``nll * mask``."""

from __future__ import annotations

import math

import torch
from torch import nn

ALPHABET, CHARS = 12, 8  # one-hot size, longest transcription
STEPS, HIDDEN, MIXTURES, WINDOWS = 20, 24, 5, 3
BATCH = 8


class Window(nn.Module):
    """Graves' eq. 46-51: ``phi(t, u) = sum_k alpha exp(-beta (kappa - u)^2)`` with
    ``kappa_t = kappa_{t-1} + exp(kappa_hat)``; ``normalised`` divides phi by its sum over the
    characters, as some ports do to keep the window a convex combination."""

    def __init__(self, hidden: int, k: int, normalised: bool = False):
        super().__init__()
        self.params = nn.Linear(hidden, 3 * k)
        self.normalised = normalised

    def forward(self, h, kappa_prev, chars, char_mask):
        a_hat, b_hat, k_hat = self.params(h).chunk(3, -1)
        alpha, beta = a_hat.exp(), b_hat.exp()
        kappa = kappa_prev + k_hat.exp() / 4  # ~ a quarter character per pen point
        u = torch.arange(chars.shape[1], dtype=h.dtype)
        phi = (alpha[..., None] * torch.exp(-beta[..., None] * (kappa[..., None] - u) ** 2)).sum(1)
        phi = phi * char_mask  # padded characters of shorter lines
        if self.normalised:
            phi = phi / phi.sum(-1, keepdim=True)
        return (phi[..., None] * chars).sum(1), kappa


class MDNHead(nn.Module):
    """The mixture density output layer (Graves' eq. 17-22), with the sampling bias of
    section 5.4 (``bias`` sharpens pi and shrinks sigma; 0 while training)."""

    def __init__(self, d: int, m: int):
        super().__init__()
        self.linear = nn.Linear(d, 1 + 6 * m)

    def forward(self, h, bias: float = 0.0):
        y = self.linear(h)
        e_hat = y[..., 0]
        pi_hat, mu1, mu2, s1_hat, s2_hat, rho_hat = y[..., 1:].chunk(6, -1)
        pi = torch.softmax(pi_hat * (1 + bias), -1)
        sigma1, sigma2 = torch.exp(s1_hat - bias), torch.exp(s2_hat - bias)
        rho = torch.tanh(rho_hat)
        eos = torch.sigmoid(e_hat)
        return pi, mu1, mu2, sigma1, sigma2, rho, eos


def clip_grad(t: torch.Tensor, bound: float) -> torch.Tensor:
    """Graves clips the derivatives w.r.t. the LSTM outputs and the output layer's inputs."""
    if t.requires_grad:
        t.register_hook(lambda g: g.clamp(-bound, bound))
    return t


class Synthesis(nn.Module):
    def __init__(self, normalised_window: bool = False):
        super().__init__()
        self.lstm1 = nn.LSTMCell(3 + ALPHABET, HIDDEN)
        self.window = Window(HIDDEN, WINDOWS, normalised_window)
        self.lstm2 = nn.LSTM(3 + ALPHABET + HIDDEN, HIDDEN, batch_first=True)
        self.head = MDNHead(2 * HIDDEN, MIXTURES)

    def forward(self, strokes, chars, char_mask, bias: float = 0.0):
        b, t, _ = strokes.shape
        h = c = strokes.new_zeros(b, HIDDEN)
        w = strokes.new_zeros(b, ALPHABET)
        kappa = strokes.new_zeros(b, WINDOWS)
        hs, ws = [], []
        for i in range(t):
            h, c = self.lstm1(torch.cat([strokes[:, i], w], -1), (h, c))
            h = clip_grad(h, 10.0)
            w, kappa = self.window(h, kappa, chars, char_mask)
            hs.append(h)
            ws.append(w)
        h1, win = torch.stack(hs, 1), torch.stack(ws, 1)
        h2, _ = self.lstm2(torch.cat([strokes, win, h1], -1))
        h2 = clip_grad(h2, 10.0)
        return self.head(clip_grad(torch.cat([h1, h2], -1), 100.0), bias)


def make_synthesis() -> nn.Module:
    torch.manual_seed(0)
    return Synthesis()


def make_normalised_window() -> nn.Module:
    torch.manual_seed(0)
    return Synthesis(normalised_window=True)


def log_bivariate(x1, x2, mu1, mu2, s1, s2, rho):
    """log N(x | mu, sigma, rho) of Graves' eq. 24-25, per mixture component."""
    z1, z2 = (x1 - mu1) / s1, (x2 - mu2) / s2
    z = z1 ** 2 + z2 ** 2 - 2 * rho * z1 * z2
    one_m = 1 - rho ** 2
    return (-z / (2 * one_m) - math.log(2 * math.pi) - torch.log(s1) - torch.log(s2)
            - 0.5 * torch.log(one_m))


def step_nll(out, target, prob_space: bool = False):
    """Per pen point NLL (B, T): the mixture by logsumexp (or summed in probability space,
    Graves' eq. 26 written as printed) plus the end-of-stroke Bernoulli."""
    pi, mu1, mu2, s1, s2, rho, eos = out
    x1, x2, pen = target[..., :1], target[..., 1:2], target[..., 2]
    log_n = log_bivariate(x1, x2, mu1, mu2, s1, s2, rho)
    if prob_space:
        mix = torch.log((pi * torch.exp(log_n)).sum(-1))
    else:
        mix = torch.logsumexp(torch.log(pi) + log_n, -1)
    pen_ll = pen * torch.log(eos) + (1 - pen) * torch.log(1 - eos)
    return -(mix + pen_ll)


def mdn_loss(*args):
    """Masked NLL averaged over the batch's real pen points (the usual port)."""
    *out, target, mask = args
    return (step_nll(out, target) * mask).sum() / mask.sum()


def mdn_loss_prob(*args):
    *out, target, mask = args
    return (step_nll(out, target, prob_space=True) * mask).sum() / mask.sum()


def mdn_loss_per_line(*args):
    """Each line's mean NLL over its own pen points, then the batch mean (lines weigh the
    same whatever their length)."""
    *out, target, mask = args
    return ((step_nll(out, target) * mask).sum(1) / mask.sum(1)).mean()


def mdn_loss_dist(*args):
    """The mixture by torch.distributions, as ports built on MixtureSameFamily write it: the
    bivariate normal's Cholesky factor from sigma and rho, and the Bernoulli's log_prob."""
    pi, mu1, mu2, s1, s2, rho, eos, target, mask = args
    zero = torch.zeros_like(s1)
    tril = torch.stack([torch.stack([s1, zero], -1),
                        torch.stack([rho * s2, s2 * torch.sqrt(1 - rho ** 2)], -1)], -2)
    mix = torch.distributions.MixtureSameFamily(
        torch.distributions.Categorical(probs=pi),
        torch.distributions.MultivariateNormal(torch.stack([mu1, mu2], -1), scale_tril=tril))
    ll = mix.log_prob(target[..., :2]) + torch.distributions.Bernoulli(probs=eos).log_prob(
        target[..., 2])
    return -(ll * mask).sum() / mask.sum()


def strokes_batch(g: torch.Generator, n: int = BATCH):
    """Normalised pen offsets of ``n`` lines of 12..STEPS points, zero-padded, with the
    stroke mask, the one-hot transcriptions of 3..CHARS characters and their mask."""
    lens = torch.randint(12, STEPS + 1, (n,), generator=g)
    xy = torch.randn(n, STEPS, 2, generator=g) * 0.5 + 0.1
    pen = (torch.rand(n, STEPS, generator=g) < 0.15).float()
    mask = (torch.arange(STEPS) < lens[:, None]).float()
    target = torch.cat([xy, pen[..., None]], -1) * mask[..., None]
    clens = torch.randint(3, CHARS + 1, (n,), generator=g)
    ids = torch.randint(0, ALPHABET, (n, CHARS), generator=g)
    char_mask = (torch.arange(CHARS) < clens[:, None]).float()
    chars = nn.functional.one_hot(ids, ALPHABET).float() * char_mask[..., None]
    return target, mask, chars, char_mask


def teacher_forced(target: torch.Tensor) -> torch.Tensor:
    """The network's input at t is the pen point of t - 1 (a zero start point)."""
    return torch.cat([torch.zeros_like(target[:, :1]), target[:, :-1]], 1)


def resume_correlated(model: nn.Module, factor: float = 40.0) -> None:
    """The state of a checkpoint trained long on ruled, diagonal strokes (underlines, hatching):
    the correlation rows of the output layer grew until ``tanh`` rounds rho to +-1 in float32
    (|rho_hat| > 9)."""
    with torch.no_grad():
        model.head.linear.weight[-MIXTURES:] *= factor


def resume_collapsed(model: nn.Module, factor: float = 600.0) -> None:
    """The state of a checkpoint whose mixture collapsed onto few components (an MDN's usual
    mode collapse): the mixture-weight rows of the output layer grew until the softmax's
    smallest weights underflow to exactly 0 in float32."""
    with torch.no_grad():
        model.head.linear.weight[1:1 + MIXTURES] *= factor


class Lines(torch.utils.data.Dataset):
    """Lines of variable length as a dataset holds them: (points, characters), unpadded."""

    def __init__(self, n: int = 32, empty: int | None = None):
        g = torch.Generator().manual_seed(3)
        self.items = []
        for _ in range(n):
            t = int(torch.randint(12, STEPS + 1, (1,), generator=g)) * (len(self.items) != empty)
            c = int(torch.randint(3, CHARS + 1, (1,), generator=g))
            xy = torch.randn(t, 2, generator=g) * 0.5 + 0.1
            pen = (torch.rand(t, 1, generator=g) < 0.15).float()
            self.items.append((torch.cat([xy, pen], -1), torch.randint(0, ALPHABET, (c,), generator=g)))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def collate(items):
    """pad_sequence of the points and characters, with their masks (the ports' collate_fn)."""
    pts = nn.utils.rnn.pad_sequence([p for p, _ in items], batch_first=True)
    ids = nn.utils.rnn.pad_sequence([c for _, c in items], batch_first=True)
    mask = (torch.arange(pts.shape[1]) < torch.tensor([len(p) for p, _ in items])[:, None])
    char_mask = (torch.arange(ids.shape[1]) < torch.tensor([len(c) for _, c in items])[:, None])
    chars = nn.functional.one_hot(ids, ALPHABET).float() * char_mask[..., None]
    return pts, mask.float(), chars, char_mask.float()


def long_lines(g: torch.Generator, short: int, n: int = BATCH, steps: int = 60):
    """Lines of ``steps`` pen points with transcriptions of CHARS characters, but line
    ``short``, whose transcription was cut to its first character (a misaligned label)."""
    xy = torch.randn(n, steps, 2, generator=g) * 0.5 + 0.1
    pen = (torch.rand(n, steps, generator=g) < 0.15).float()
    target, mask = torch.cat([xy, pen[..., None]], -1), torch.ones(n, steps)
    ids = torch.randint(0, ALPHABET, (n, CHARS), generator=g)
    char_mask = torch.ones(n, CHARS)
    char_mask[short, 1:] = 0.0
    chars = nn.functional.one_hot(ids, ALPHABET).float() * char_mask[..., None]
    return target, mask, chars, char_mask


def resume_sure_of_pen_lifts(model: nn.Module) -> None:
    """A checkpoint whose end-of-stroke logit grew past sigmoid's float32 range (e_hat > 17
    at many pen points: the data's rare pen lifts, weighted up by a careless class weight)."""
    with torch.no_grad():
        model.head.linear.weight[0] *= 300
        model.head.linear.bias[0] = 40.0
