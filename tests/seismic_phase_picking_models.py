"""Seismic phase picking as PhaseNet (Zhu & Beroza 2019) and its PyTorch ports (SeisBench's
``PhaseNet``) write it, for ``test_seismic_phase_picking``.

- ``make_waveforms``: three-component (Z, N, E) windows at 100 Hz: background noise, a P
  wavelet on every channel and a larger S wavelet on the horizontals; Gaussian-shaped soft labels
  (sigma 0.1 s) around the picks, the noise class ``clamp(1 - P - S, 0)``. Planted data
  conditions: a dead component (a broken sensor's channel, all zeros), a gap the pipeline
  filled with NaN, a noise-only window (augmentation by noise windows), a clipped trace at the
  digitiser limit stored as int32.
- ``normalize``: SeisBench's ``Normalize`` in the data pipeline: demean, then each channel
  divided by its peak amplitude or its std (``eps`` added, or not).
- ``PhaseNet``: an FFT band-pass (1-45 Hz by masking ``rfft`` bins), per-channel
  normalisation inside the model (std or peak), a 1-D U-Net (strided convs down, transposed
  convs up, skips), logits for P, S and noise; optionally EQTransformer's attention at the
  bottleneck (the gaps, filled with 0, masked as keys: ``forward(x, gaps)``), its detection
  head, and noise windows added at a target SNR (``forward(x, noise=...)``).
- Losses: PhaseNet's class-weighted cross-entropy against the soft labels (``log_softmax``, or
  ``log(softmax)`` written by hand), ``kl_div``, the labels renormalised per sample, class
  weights from the batch's own label mass, a pick-focused variant averaged over each window's
  own pick label mass, and EQTransformer's detection BCE written by hand.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

SR, T, SIGMA = 100, 256, 10.0
CLASS_WEIGHTS = torch.tensor([1.0, 1.0, 0.3])  # P, S, noise (PhaseNet's down-weighted noise)
INT32_MAX = 2 ** 31 - 1


def wavelet(n: int, f: float, g: torch.Generator) -> torch.Tensor:
    t = torch.arange(n) / SR
    return torch.sin(2 * math.pi * f * t) * torch.exp(-t * 6.0) * (1 + 0.1 * torch.rand(1, generator=g))


def gaussian_labels(p: int | None, s: int | None) -> torch.Tensor:
    """(3, T) soft labels P, S, noise; the noise class is what P and S leave, clipped at 0."""
    t = torch.arange(T, dtype=torch.float32)
    lab = torch.zeros(3, T)
    if p is not None:
        lab[0] = torch.exp(-((t - p) ** 2) / (2 * SIGMA ** 2))
    if s is not None:
        lab[1] = torch.exp(-((t - s) ** 2) / (2 * SIGMA ** 2))
    lab[2] = (1 - lab[0] - lab[1]).clamp(min=0)
    return lab


def stack_labels(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The labels of two stacked events: picks added, the noise class what they leave (the
    single-event builder's clamp at 0 forgotten: -1 where one's P sits on the other's S)."""
    pick = a[:2] + b[:2]
    return torch.cat([pick, 1 - pick.sum(0, keepdim=True)])


def make_waveforms(n: int, seed: int, dead: int | None = None, gap: int | None = None,
                   noise_only: int | tuple = (), clipped: int | None = None,
                   outage: int | None = None, stacked: int | None = None,
                   unlabelled: int | None = None):
    """(n, 3, T) waveforms (counts) and (n, 3, T) labels; each keyword plants one window."""
    g = torch.Generator().manual_seed(seed)
    x = 0.05 * torch.randn(n, 3, T, generator=g)
    y = torch.zeros(n, 3, T)
    for i in range(n):
        if i in (noise_only if isinstance(noise_only, tuple) else (noise_only,)):
            # a window cut from the noise data set: no pick
            y[i] = gaussian_labels(None, None)
            continue
        if i == unlabelled:  # a noise window whose label builder never ran: all zeros
            continue
        p = int(torch.randint(40, 110, (1,), generator=g))
        s = p + int(torch.randint(40, 90, (1,), generator=g))
        x[i, :, p:] += 0.6 * wavelet(T - p, 8.0, g)
        x[i, 1:, s:] += 1.5 * wavelet(T - s, 4.0, g)
        y[i] = gaussian_labels(p, s)
    if stacked is not None:  # augmentation: a second event stacked, its P on the first's S
        s1 = int(y[stacked, 1].argmax())
        x[stacked, :, s1:] += 0.6 * wavelet(T - s1, 8.0, g)
        y[stacked] = stack_labels(y[stacked], gaussian_labels(s1, None))
    x = x * 1e4  # raw digitiser counts
    if dead is not None:  # a broken sensor: its E component records nothing
        x[dead, 2] = 0.0
    if gap is not None:  # a telemetry gap the merge filled with NaN (obspy's fill_value=None)
        x[gap, :, 100:140] = float("nan")
    if outage is not None:  # the station was down for the whole window
        x[outage] = float("nan")
    if clipped is not None:  # the digitiser saturated: the trace sits at its limit
        x[clipped] = x[clipped].sign() * INT32_MAX
    return x, y


def normalize(x: torch.Tensor, how: str = "peak", eps: float = 1e-10) -> torch.Tensor:
    """SeisBench's ``Normalize(demean_axis=-1, amp_norm_axis=-1, amp_norm_type=how)``."""
    x = x - x.mean(-1, keepdim=True)
    if how == "peak":
        return x / (x.abs().amax(-1, keepdim=True) + eps)
    return x / (x.std(-1, keepdim=True) + eps)


def dataset(n: int, seed: int, bad: dict | None = None, how: str | None = "peak",
            eps: float = 1e-10, masked: bool = False, noise: bool = False):
    """``masked``: gaps filled with 0 and returned as a (n, T) mask (True: missing)."""
    bad = dict(bad or {})
    noise_dead = bad.pop("noise_dead", None)
    x, y = make_waveforms(n, seed, **bad)
    gaps = torch.isnan(x).any(1)
    if masked:
        x = x.nan_to_num(0.0)
    if how is not None:
        x = normalize(x, how, eps)
    if noise:  # noise windows to add, drawn from the noise data set
        z = 0.05 * torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + 99))
        if noise_dead is not None:  # a noise window from a station with a dead component
            z[noise_dead, 2] = 0.0
        return torch.utils.data.TensorDataset(x, z, y)
    return torch.utils.data.TensorDataset(x, gaps, y) if masked else \
        torch.utils.data.TensorDataset(x, y)


class FFTBandpass(nn.Module):
    """A zero-phase band-pass by masking the ``rfft`` bins outside [lo, hi] Hz."""

    def __init__(self, lo: float = 1.0, hi: float = 45.0):
        super().__init__()
        f = torch.fft.rfftfreq(T, 1 / SR)
        self.register_buffer("mask", ((f >= lo) & (f <= hi)).float(), persistent=False)

    def forward(self, x):
        return torch.fft.irfft(torch.fft.rfft(x) * self.mask, n=x.shape[-1])


class TraceNorm(nn.Module):
    """Each channel of each window divided by its std or its peak amplitude."""

    def __init__(self, how: str = "std", eps: float = 1e-6):
        super().__init__()
        self.how, self.eps = how, eps

    def forward(self, x):
        x = x - x.mean(-1, keepdim=True)
        if self.how == "std":
            scale = x.std(-1, keepdim=True)
        else:
            scale = x.abs().amax(-1, keepdim=True)
        return x / (scale + self.eps)


def block(cin: int, cout: int, stride: int = 1, bn: bool = True) -> nn.Sequential:
    return nn.Sequential(nn.Conv1d(cin, cout, 7, stride=stride, padding=3),
                         nn.BatchNorm1d(cout) if bn else nn.Identity(), nn.ReLU())


class PhaseNet(nn.Module):
    """SeisBench's PhaseNet, shrunk: depth 3, strides of 4, skips concatenated on the way up."""

    def __init__(self, norm: str | None = "std", eps: float = 1e-6, bandpass: bool = True,
                 bn: bool = True, attn: bool = False, detect: bool = False):
        super().__init__()
        self.bandpass = FFTBandpass() if bandpass else nn.Identity()
        self.norm = TraceNorm(norm, eps) if norm else nn.Identity()
        self.inc = block(3, 8, bn=bn)
        self.down1, self.down2 = block(8, 12, 4, bn), block(12, 16, 4, bn)
        self.up2 = nn.ConvTranspose1d(16, 12, 4, stride=4)
        self.dec2 = block(24, 12, bn=bn)
        self.up1 = nn.ConvTranspose1d(12, 8, 4, stride=4)
        self.dec1 = block(16, 8, bn=bn)
        self.out = nn.Conv1d(8, 3, 1)
        # EQTransformer's attention at the bottleneck, the gaps' samples masked out as keys
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True) if attn else None
        self.detector = nn.Conv1d(8, 1, 1) if detect else None  # EQTransformer's detection

    def forward(self, x, gaps=None, noise=None, snr_db: float = 10.0):
        if noise is not None and self.training:  # noise windows added at a target SNR
            scale = x.std(-1, keepdim=True) / (noise.std(-1, keepdim=True) * 10 ** (snr_db / 20))
            x = x + scale * noise
        x = self.norm(self.bandpass(x))
        e0 = self.inc(x)
        e1 = self.down1(e0)
        e2 = self.down2(e1)
        if self.attn is not None:
            keep = gaps[:, None].float() if gaps is not None else x.new_zeros(len(x), 1, T)
            masked = F.max_pool1d(keep, 16).squeeze(1).bool()  # (B, T / 16)
            h = e2.transpose(1, 2)
            e2 = e2 + self.attn(h, h, h, key_padding_mask=masked)[0].transpose(1, 2)
        d1 = self.dec2(torch.cat([self.up2(e2), e1], 1))
        d0 = self.dec1(torch.cat([self.up1(d1), e0], 1))
        if self.detector is not None:
            return self.out(d0), self.detector(d0).squeeze(1)
        return self.out(d0)  # (B, 3, T) logits for P, S, noise


def make_model() -> PhaseNet:
    torch.manual_seed(0)
    return PhaseNet()


def make_no_eps() -> PhaseNet:
    """The in-model std normalisation with eps = 0 ("the data are never flat")."""
    torch.manual_seed(0)
    return PhaseNet(eps=0.0)


def make_peak_no_eps() -> PhaseNet:
    torch.manual_seed(0)
    return PhaseNet(norm="peak", eps=0.0)


def make_raw() -> PhaseNet:
    """No normalisation in the model: the pipeline's ``normalize`` is trusted to do it."""
    torch.manual_seed(0)
    return PhaseNet(norm=None)


def make_raw_no_bn() -> PhaseNet:
    """No normalisation at all: neither in the model nor BatchNorm (a small-batch fine-tune
    that dropped it), fed whatever the pipeline gives."""
    torch.manual_seed(0)
    return PhaseNet(norm=None, bn=False)


def make_attention() -> PhaseNet:
    torch.manual_seed(0)
    return PhaseNet(attn=True)


def make_detector_raw() -> PhaseNet:
    """EQTransformer-like picker and detector, no normalisation (as ``make_raw_no_bn``)."""
    torch.manual_seed(0)
    return PhaseNet(norm=None, bn=False, detect=True)


def make_detector() -> PhaseNet:
    torch.manual_seed(0)
    return PhaseNet(detect=True)


def eqt_loss(out, y):
    """The picks' cross-entropy plus the detection's BCE on ``sigmoid`` written by hand, the
    detection target what the noise class leaves."""
    logits, det_logit = out
    det, d = torch.sigmoid(det_logit), 1 - y[:, 2]
    bce = -(d * torch.log(det) + (1 - d) * torch.log(1 - det)).mean()
    return phasenet_loss(logits, y) + bce


def phasenet_loss(logits, y):
    """PhaseNet's class-weighted cross-entropy against the soft labels."""
    logp = F.log_softmax(logits, 1)
    w = CLASS_WEIGHTS.to(logits)[None, :, None]
    return -(w * y * logp).sum(1).mean()


def hand_log_loss(logits, y):
    """The same cross-entropy with the log of the softmax written by hand."""
    p = torch.softmax(logits, 1)
    w = CLASS_WEIGHTS.to(logits)[None, :, None]
    return -(w * y * torch.log(p)).sum(1).mean()


def kl_loss(logits, y):
    """The soft labels as a distribution: KL(y || softmax) (SeisBench's users' ``KLDivLoss``)."""
    return F.kl_div(F.log_softmax(logits, 1), y, reduction="batchmean")


def normalised_label_loss(logits, y):
    """The labels renormalised to sum to 1 per sample before the cross-entropy (a window of the
    noise data set comes with all-zero labels: the builder never ran)."""
    y = y / y.sum(1, keepdim=True)
    return -(y * F.log_softmax(logits, 1)).sum(1).mean()


def balanced_loss(logits, y):
    """Class weights from the batch's own label mass, inverse frequency (``n / (3 * mass)``):
    a batch of noise windows only has no P or S mass."""
    mass = y.sum((0, 2))
    w = (mass.sum() / (3 * mass))[None, :, None]
    return -(w * y * F.log_softmax(logits, 1)).sum(1).mean()


def pick_focused_loss(logits, y):
    """Cross-entropy averaged over each window's pick label mass (the samples near a pick):
    a window without a pick has a mass of 0, and 0/0."""
    ce = -(y * F.log_softmax(logits, 1)).sum(1)  # (B, T)
    mass = y[:, :2].sum(1)
    return ((ce * mass).sum(1) / mass.sum(1)).mean()


def pick_focused_guarded(logits, y):
    ce = -(y * F.log_softmax(logits, 1)).sum(1)
    mass = y[:, :2].sum(1)
    return ((ce * mass).sum(1) / mass.sum(1).clamp_min(1e-6)).mean()
