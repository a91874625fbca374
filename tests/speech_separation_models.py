"""Speech separation and enhancement as Conv-TasNet / asteroid / DCCRN-style repositories write
it, for ``test_speech_separation``: a Conv1d encoder, a TCN mask estimator with global layer
norm, a ConvTranspose1d decoder; SI-SNR with permutation invariant training (every permutation
of the speakers, ``torch.stack`` then ``min``); an STFT-domain enhancer with a complex ratio
mask; a multi-resolution STFT loss; mixtures made at a random SNR in DataLoader workers;
variable-length clips zero-padded by a ``collate_fn``.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn
from torch.utils.data import Dataset

L, N, C = 16, 32, 2  # encoder kernel, filters, speakers
N_FFT, HOP = 64, 16


class GlobLN(nn.Module):
    """Conv-TasNet's global layer norm over channels and time."""

    def __init__(self, ch: int):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(1, ch, 1))
        self.beta = nn.Parameter(torch.zeros(1, ch, 1))

    def forward(self, x):
        mean = x.mean(dim=(1, 2), keepdim=True)
        var = ((x - mean) ** 2).mean(dim=(1, 2), keepdim=True)
        return self.gamma * (x - mean) / torch.sqrt(var + 1e-8) + self.beta


class TCNBlock(nn.Module):
    def __init__(self, ch: int, hid: int, dilation: int):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv1d(ch, hid, 1), nn.PReLU(), GlobLN(hid),
            nn.Conv1d(hid, hid, 3, padding=dilation, dilation=dilation, groups=hid),
            nn.PReLU(), GlobLN(hid), nn.Conv1d(hid, ch, 1))

    def forward(self, x):
        return x + self.net(x)


class ConvTasNet(nn.Module):
    def __init__(self, n_src: int = C):
        super().__init__()
        self.n_src = n_src
        self.encoder = nn.Conv1d(1, N, L, stride=L // 2, bias=False)
        self.norm = GlobLN(N)
        self.bottleneck = nn.Conv1d(N, 24, 1)
        self.tcn = nn.Sequential(*[TCNBlock(24, 48, 2 ** i) for i in range(3)])
        self.mask_net = nn.Sequential(nn.PReLU(), nn.Conv1d(24, n_src * N, 1))
        self.decoder = nn.ConvTranspose1d(N, 1, L, stride=L // 2, bias=False)

    def forward(self, mix):  # (B, T) -> (B, n_src, T)
        w = torch.relu(self.encoder(mix.unsqueeze(1)))
        m = self.mask_net(self.tcn(self.bottleneck(self.norm(w))))
        m = torch.sigmoid(m.view(mix.shape[0], self.n_src, N, -1))
        est = self.decoder((w.unsqueeze(1) * m).flatten(0, 1))  # (B * n_src, 1, T)
        est = nn.functional.pad(est, (0, mix.shape[-1] - est.shape[-1]))
        return est.view(mix.shape[0], self.n_src, -1)


def make_conv_tasnet() -> nn.Module:
    torch.manual_seed(0)
    return ConvTasNet()


def pairwise_neg_sisdr(est, tgt, eps: float = 1e-8, amplitude: bool = False):
    """asteroid's ``PairwiseNegSDR("sisdr")``: (B, n_src, T) x2 -> (B, n_src, n_src).
    ``amplitude``: 20 log10 of a ratio of norms, each the sqrt of a sum of squares, whose
    derivative is infinite at a silent reference source's projection of 0."""
    est = est - est.mean(-1, keepdim=True)
    tgt = tgt - tgt.mean(-1, keepdim=True)
    s_tgt, s_est = tgt.unsqueeze(1), est.unsqueeze(2)
    dot = (s_est * s_tgt).sum(-1, keepdim=True)
    proj = dot * s_tgt / ((s_tgt ** 2).sum(-1, keepdim=True) + eps)
    noise = s_est - proj
    if amplitude:
        ratio = (proj ** 2).sum(-1).sqrt() / ((noise ** 2).sum(-1).sqrt() + eps)
        return -20 * torch.log10(ratio + eps)
    ratio = (proj ** 2).sum(-1) / ((noise ** 2).sum(-1) + eps)
    return -10 * torch.log10(ratio + eps)


class PITSISNR(nn.Module):
    """Permutation invariant SI-SNR: every permutation's mean over the sources, stacked, min."""

    def __init__(self, amplitude: bool = False):
        super().__init__()
        self.amplitude = amplitude

    def forward(self, est, tgt):
        pw = pairwise_neg_sisdr(est, tgt, amplitude=self.amplitude)
        n = pw.shape[-1]
        perms = list(itertools.permutations(range(n)))
        losses = torch.stack([sum(pw[:, i, p[i]] for i in range(n)) / n for p in perms], 1)
        return losses.min(1).values.mean()


def mixtures(step: int, size: int = 4, length: int = 800, silent: tuple = ()):
    """``(mix, sources)``: two speakers per mixture; (row, src) in ``silent`` is a silent source."""
    g = torch.Generator().manual_seed(step)
    t = torch.arange(length) / 8000.0
    f = torch.rand(size, C, 1, generator=g) * 400 + 100
    src = torch.sin(2 * torch.pi * f * t) * (0.5 + torch.rand(size, C, 1, generator=g))
    src = src + 0.05 * torch.randn(size, C, length, generator=g)
    for row, s in silent:
        src[row, s] = 0.0
    return src.sum(1), src


# ---------------------------------------------------------------------------------------------
# STFT-domain enhancement with a complex ratio mask


class CRMEnhancer(nn.Module):
    """DCCRN-style: STFT, a small conv net on the log magnitude predicting a complex ratio mask
    (real, imaginary), applied by complex multiplication, iSTFT back."""

    def __init__(self, sqrt_mag: bool = False):
        super().__init__()
        self.sqrt_mag = sqrt_mag
        self.register_buffer("window", torch.hann_window(N_FFT))
        f = N_FFT // 2 + 1
        self.net = nn.Sequential(nn.Conv1d(f, 64, 3, padding=1), nn.PReLU(),
                                 nn.Conv1d(64, 2 * f, 3, padding=1))

    def forward(self, noisy):
        spec = torch.stft(noisy, N_FFT, HOP, window=self.window, return_complex=True)
        re, im = spec.real, spec.imag
        mag = torch.sqrt(re ** 2 + im ** 2 + 1e-8)
        mr, mi = torch.tanh(self.net(torch.log(mag))).chunk(2, dim=1)
        est_re, est_im = mr * re - mi * im, mr * im + mi * re
        if self.sqrt_mag:  # polar: the magnitude without an eps (sqrt's derivative at 0)
            est_mag = torch.sqrt(est_re ** 2 + est_im ** 2)
            est_pha = torch.atan2(est_im, est_re)
            est_re, est_im = est_mag * torch.cos(est_pha), est_mag * torch.sin(est_pha)
        est = torch.istft(torch.complex(est_re, est_im), N_FFT, HOP, window=self.window,
                          length=noisy.shape[-1])
        return est


def make_crm_enhancer() -> nn.Module:
    torch.manual_seed(0)
    return CRMEnhancer()


def make_crm_enhancer_polar() -> nn.Module:
    torch.manual_seed(0)
    return CRMEnhancer(sqrt_mag=True)


def stft_mag(x, fft_size, hop, win, clamp: bool = True):
    spec = torch.stft(x, fft_size, hop, window=torch.hann_window(win, device=x.device),
                      win_length=win, return_complex=True)
    power = spec.real ** 2 + spec.imag ** 2
    return torch.sqrt(power.clamp(min=1e-7) if clamp else power).transpose(1, 2)


class MultiResolutionSTFTLoss(nn.Module):
    """parallel_wavegan's multi-resolution STFT loss: spectral convergence
    ``||S - Ŝ||_F / ||S||_F`` plus a log-magnitude L1, averaged over three resolutions."""

    def __init__(self, clamp: bool = True, db: bool = False):
        super().__init__()
        self.clamp = clamp
        self.db = db  # the log term as a log-power in dB: 10 * log10(|S|²)
        self.resolutions = [(64, 16, 48), (128, 32, 96), (32, 8, 24)]

    def forward(self, est, clean):
        sc = mag = 0.0
        for fft, hop, win in self.resolutions:
            x, y = stft_mag(est, fft, hop, win, self.clamp), stft_mag(clean, fft, hop, win,
                                                                      self.clamp)
            sc = sc + torch.norm(y - x, p="fro") / torch.norm(y, p="fro")
            if self.db:
                mag = mag + nn.functional.l1_loss(10 * torch.log10(y ** 2),
                                                  10 * torch.log10(x ** 2)) / 20
            else:
                mag = mag + nn.functional.l1_loss(torch.log(y), torch.log(x))
        return (sc + mag) / len(self.resolutions)


class NoisyMixtures(Dataset):
    """Clean speech plus noise at a random SNR, as enhancement recipes mix on the fly: the
    noise is scaled to the speech's RMS, times 10 ** (-snr / 20)."""

    def __init__(self, n: int, length: int = 800, silent_speech: tuple = (),
                 peak_norm: bool = False):
        self.n, self.length, self.peak_norm = n, length, peak_norm
        self.silent_speech = silent_speech

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(1000 + i)
        t = torch.arange(self.length) / 8000.0
        clean = torch.sin(2 * torch.pi * (100 + 300 * torch.rand(1, generator=g)) * t) * 0.3
        noise = torch.randn(self.length, generator=g)
        if i in self.silent_speech:
            clean = torch.zeros(self.length)  # a silent clip in the corpus
        snr = torch.empty(1).uniform_(-5, 15, generator=g)
        rms_s, rms_n = clean.pow(2).mean().sqrt(), noise.pow(2).mean().sqrt()
        noise = noise * (rms_s / rms_n) * 10 ** (-snr / 20)
        if self.peak_norm:  # the reference peak-normalised after mixing: 0/0 when silent
            return clean + noise, clean / clean.abs().max()
        return clean + noise, clean


def collate_padded(items):
    """Pads variable-length (noisy, clean) pairs with zeros to the longest; returns lengths."""
    lens = torch.tensor([len(n) for n, _ in items])
    pad = int(lens.max())
    noisy = torch.stack([nn.functional.pad(n, (0, pad - len(n))) for n, _ in items])
    clean = torch.stack([nn.functional.pad(c, (0, pad - len(c))) for _, c in items])
    return noisy, clean, lens


class VariableLength(Dataset):
    """(noisy, clean) pairs of 800 samples, those in ``short`` of 400 (padded by the collate)."""

    def __init__(self, n: int, short: tuple = ()):
        self.n, self.short = n, short

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(2000 + i)
        length = 400 if i in self.short else 800
        t = torch.arange(length) / 8000.0
        clean = torch.sin(2 * torch.pi * (100 + 300 * torch.rand(1, generator=g)) * t) * 0.3
        clean = clean + 0.01 * torch.randn(length, generator=g)  # a recording's noise floor
        return clean + 0.1 * torch.randn(length, generator=g), clean
