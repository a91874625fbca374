"""EEG and ECG models as the biosignal repositories write them (braindecode's ShallowFBCSPNet,
Lawhern's EEGNet, Ribeiro's / PTB-XL's 1D ResNet, a log-Euclidean tangent-space network), at
module level so that ``nanreplay`` rebuilds them from the bundle, for ``test_biosignals``.

- ``ShallowConvNet``: temporal conv, spatial conv over all electrodes, square, average pooling
  of the power, then its log (``safe=False``: ``torch.log`` without braindecode's clamp).
- ``EEGNet``: temporal conv, depthwise spatial conv, separable conv, BatchNorm, ELU; with
  ``zscore=True`` each channel of each trial is standardised inside ``forward`` (no eps).
- ``WindowDataset``: trials cut from continuous recordings, each channel z-scored in
  ``__getitem__`` (the normalisation many pipelines do in the DataLoader's workers).
- ``ResNet1d``: the 12-lead ECG classifier's residual blocks (conv, BN, ReLU, dropout, a
  max-pooled skip), multi-label logits for ``BCEWithLogitsLoss(pos_weight=neg / pos)``.
- ``TangentSpaceNet``: a learnable per-channel FIR filter, the trial's spatial covariance,
  its matrix log by ``torch.linalg.eigh`` (log of the eigenvalues), the upper triangle as
  features; ``floor`` clamps the eigenvalues first (SPDNet's ReEig).
- ``ChannelAttentionNet``: electrodes as tokens, a key padding mask for the missing ones.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

N_CHANS, N_TIMES, N_CLASSES, FS = 8, 200, 4, 100.0

# ---------------------------------------------------------------------------------------------
# data: motor imagery trials and ECG records


def mi_batch(g: torch.Generator, n: int = 16, dropout_row: int | None = None,
             flat: tuple[int, int] | None = None, volts_row: int | None = None,
             scaled_row: int | None = None, reference: int | None = None):
    """Synthetic motor-imagery trials ``(n, C, T)`` (µV-scaled): each class a mu-band
    rhythm of its own frequency over its own pair of electrodes, on pink-ish noise.
    ``dropout_row``: an amplifier dropout, every electrode at 0 for one second of the trial;
    ``flat``: (row, channel), a disconnected electrode the acquisition wrote as zeros."""
    y = torch.randint(0, N_CLASSES, (n,), generator=g)
    t = torch.arange(N_TIMES) / FS
    x = torch.randn(n, N_CHANS, N_TIMES, generator=g)
    x = x.cumsum(-1) * 0.1 + x  # a little low-frequency drift
    freq = 8.0 + 1.5 * y.float()
    wave = torch.sin(2 * math.pi * freq[:, None] * t[None])
    for c in range(2):
        x[torch.arange(n), (2 * y + c) % N_CHANS] += 3 * wave
    if dropout_row is not None:
        x[dropout_row, :, 60:170] = 0.0
    if flat is not None:
        x[flat[0], flat[1]] = 0.0
    if reference is not None:  # the reference electrode, 0 against itself
        x[:, reference] = 0.0
    if volts_row is not None:  # (the others in µV)
        x[volts_row] *= 1e-6
    if scaled_row is not None:  # a recording exported in nV, 1000x the others' µV
        x[scaled_row] *= 1e3
    return x, y


def ecg_batch(g: torch.Generator, n: int = 16, leads: int = 12, length: int = 256,
              labels: int = 5):
    """Synthetic 12-lead ECG records and multi-hot diagnostic superclasses (NORM, MI, STTC,
    CD, HYP as PTB-XL's); label 4 (HYP) is rare and absent from the first batches."""
    y = (torch.rand(n, labels, generator=g) < torch.tensor([0.5, 0.3, 0.3, 0.2, 0.0])).float()
    t = torch.arange(length) / 100.0
    beat = torch.sin(2 * math.pi * 1.2 * t) ** 15
    x = beat + 0.1 * torch.randn(n, leads, length, generator=g)
    x = x + y[:, :1, None] * 0.3 * torch.sin(2 * math.pi * 3 * t)
    return x, y


def label_pos_weight(labels: torch.Tensor) -> torch.Tensor:
    """``neg / pos`` per label over the training set, as the PTB-XL baselines balance a
    multi-label BCE (the bug: no floor on ``pos``, a label absent from the fold)."""
    pos = labels.sum(0)
    return (len(labels) - pos) / pos


# ---------------------------------------------------------------------------------------------
# braindecode's ShallowFBCSPNet


class ShallowConvNet(nn.Module):
    def __init__(self, n_chans: int = N_CHANS, n_classes: int = N_CLASSES,
                 n_times: int = N_TIMES, n_filters: int = 16, safe: bool = False):
        super().__init__()
        self.safe = safe
        # linear filters with no offset, as the FBCSP pipeline's band-pass and CSP filters are
        self.conv_time = nn.Conv2d(1, n_filters, (1, 13), bias=False)
        self.conv_spat = nn.Conv2d(n_filters, n_filters, (n_chans, 1), bias=False)
        self.pool = nn.AvgPool2d((1, 35), stride=(1, 7))
        self.drop = nn.Dropout(0.5)
        n_out = (n_times - 12 - 35) // 7 + 1
        self.classifier = nn.Conv2d(n_filters, n_classes, (1, n_out))

    def forward(self, x):  # (B, C, T)
        x = self.conv_spat(self.conv_time(x.unsqueeze(1)))
        power = self.pool(x * x)
        if self.safe:
            feats = torch.log(torch.clamp(power, min=1e-6))  # braindecode's safe_log
        else:
            feats = torch.log(power)  # the bug: log(0) in a window with no signal
        return self.classifier(self.drop(feats)).flatten(1)


def make_shallow() -> ShallowConvNet:
    torch.manual_seed(0)
    return ShallowConvNet()


def make_shallow_safe() -> ShallowConvNet:
    torch.manual_seed(0)
    return ShallowConvNet(safe=True)


# ---------------------------------------------------------------------------------------------
# Lawhern et al.'s EEGNet


class ChannelZScore(nn.Module):
    """Each electrode of each trial standardised over time, inside the model."""

    def __init__(self, eps: float = 0.0):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        std = x.std(-1, keepdim=True)
        return (x - mean) / (std + self.eps)  # the bug with eps=0: a flat electrode, 0/0


class EEGNet(nn.Module):
    def __init__(self, n_chans: int = N_CHANS, n_classes: int = N_CLASSES,
                 n_times: int = N_TIMES, f1: int = 8, d: int = 2, f2: int = 16,
                 zscore: bool = False, eps: float = 0.0):
        super().__init__()
        self.norm = ChannelZScore(eps) if zscore else nn.Identity()
        self.block1 = nn.Sequential(
            nn.Conv2d(1, f1, (1, 32), padding=(0, 16), bias=False), nn.BatchNorm2d(f1),
            nn.Conv2d(f1, f1 * d, (n_chans, 1), groups=f1, bias=False),  # depthwise spatial
            nn.BatchNorm2d(f1 * d), nn.ELU(), nn.AvgPool2d((1, 4)), nn.Dropout(0.25))
        self.block2 = nn.Sequential(
            nn.Conv2d(f1 * d, f1 * d, (1, 16), padding=(0, 8), groups=f1 * d, bias=False),
            nn.Conv2d(f1 * d, f2, 1, bias=False), nn.BatchNorm2d(f2), nn.ELU(),
            nn.AvgPool2d((1, 8)), nn.Dropout(0.25))
        self.classify = nn.Linear(f2 * (((n_times + 1) // 4 + 1) // 8), n_classes)

    def forward(self, x):  # (B, C, T)
        x = self.block2(self.block1(self.norm(x).unsqueeze(1)))
        return self.classify(x.flatten(1))


def make_eegnet() -> EEGNet:
    torch.manual_seed(0)
    return EEGNet()


class DatasetNorm(nn.Module):
    """Each electrode standardised by the training set's mean and std (a StandardScaler fit
    once, kept as buffers)."""

    def __init__(self, mean: torch.Tensor, std: torch.Tensor):
        super().__init__()
        self.register_buffer("mean", mean)
        self.register_buffer("std", std)

    def forward(self, x):
        return (x - self.mean) / self.std  # the bug: the reference electrode's std is 0


def make_eegnet_dataset_norm() -> EEGNet:
    """EEGNet behind the training set's per-electrode statistics, recorded against electrode
    0 (the reference, identically 0 after re-referencing)."""
    torch.manual_seed(0)
    model = EEGNet()
    x, _ = mi_batch(torch.Generator().manual_seed(7), n=64, reference=0)
    model.norm = DatasetNorm(x.mean((0, 2))[:, None], x.std((0, 2))[:, None])
    return model


def make_eegnet_zscore() -> EEGNet:
    torch.manual_seed(0)
    return EEGNet(zscore=True)


def max_norm_(model: EEGNet) -> None:
    """EEGNet's kernel constraints after each update: max-norm 1 on the depthwise spatial
    filters, 0.25 on the classifier."""
    with torch.no_grad():
        w = model.block1[2].weight
        w.copy_(torch.renorm(w, 2, 0, 1.0))
        model.classify.weight.copy_(torch.renorm(model.classify.weight, 2, 0, 0.25))


class WindowDataset(torch.utils.data.Dataset):
    """Trials cut from continuous recordings, each electrode z-scored in ``__getitem__``."""

    def __init__(self, recordings: torch.Tensor, labels: torch.Tensor, eps: float = 0.0):
        self.recordings, self.labels, self.eps = recordings, labels, eps

    def __len__(self):
        return len(self.recordings)

    def __getitem__(self, i):
        x = self.recordings[i]
        x = (x - x.mean(-1, keepdim=True)) / (x.std(-1, keepdim=True) + self.eps)
        return x, self.labels[i]


# ---------------------------------------------------------------------------------------------
# the 12-lead ECG ResNet


class ResBlock1d(nn.Module):
    def __init__(self, c_in: int, c_out: int, down: int):
        super().__init__()
        self.conv1 = nn.Conv1d(c_in, c_out, 9, padding=4, bias=False)
        self.bn1 = nn.BatchNorm1d(c_out)
        self.conv2 = nn.Conv1d(c_out, c_out, 9, stride=down, padding=4, bias=False)
        self.bn2 = nn.BatchNorm1d(c_out)
        self.drop = nn.Dropout(0.2)
        self.skip = nn.Sequential(nn.MaxPool1d(down, down), nn.Conv1d(c_in, c_out, 1, bias=False))

    def forward(self, x):
        h = self.drop(F.relu(self.bn1(self.conv1(x))))
        return F.relu(self.bn2(self.conv2(h)) + self.skip(x))


class ResNet1d(nn.Module):
    def __init__(self, leads: int = 12, labels: int = 5, width: int = 16):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv1d(leads, width, 15, padding=7, bias=False),
                                  nn.BatchNorm1d(width), nn.ReLU())
        self.blocks = nn.Sequential(ResBlock1d(width, width, 4), ResBlock1d(width, 2 * width, 4))
        self.head = nn.Linear(2 * width, labels)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean(-1))


def make_resnet1d() -> ResNet1d:
    torch.manual_seed(0)
    return ResNet1d()


# ---------------------------------------------------------------------------------------------
# log-Euclidean tangent space of the spatial covariance


class TangentSpaceNet(nn.Module):
    def __init__(self, n_chans: int = N_CHANS, n_classes: int = N_CLASSES, taps: int = 9,
                 floor: float = 0.0):
        super().__init__()
        self.floor = floor
        self.fir = nn.Conv1d(n_chans, n_chans, taps, padding=taps // 2, groups=n_chans,
                             bias=False)  # a learnable band-pass per electrode
        iu = torch.triu_indices(n_chans, n_chans)
        self.register_buffer("iu", iu, persistent=False)
        self.head = nn.Linear(iu.shape[1], n_classes)

    def forward(self, x):  # (B, C, T)
        x = self.fir(x)
        x = x - x.mean(-1, keepdim=True)
        cov = x @ x.transpose(-1, -2) / (x.shape[-1] - 1)
        evals, evecs = torch.linalg.eigh(cov)
        if self.floor:
            evals = evals.clamp_min(self.floor)  # ReEig: the eigenvalues rectified
        log_cov = evecs @ torch.diag_embed(torch.log(evals)) @ evecs.transpose(-1, -2)
        return self.head(log_cov[:, self.iu[0], self.iu[1]])


def make_tangent() -> TangentSpaceNet:
    torch.manual_seed(0)
    return TangentSpaceNet()


def make_tangent_reeig() -> TangentSpaceNet:
    torch.manual_seed(0)
    return TangentSpaceNet(floor=1e-4)


# ---------------------------------------------------------------------------------------------
# electrodes as tokens, the missing ones masked


class ChannelAttentionNet(nn.Module):
    def __init__(self, n_times: int = N_TIMES, dim: int = 32, n_classes: int = N_CLASSES):
        super().__init__()
        self.embed = nn.Conv1d(1, dim, 25, stride=25)
        self.proj = nn.Linear(dim * (n_times // 25), dim)
        self.att = nn.MultiheadAttention(dim, 4, batch_first=True)
        self.head = nn.Linear(dim, n_classes)

    def forward(self, x, missing):  # x (B, C, T), missing (B, C) bool
        b, c, t = x.shape
        tok = self.proj(F.gelu(self.embed(x.reshape(b * c, 1, t))).reshape(b, c, -1))
        h, _ = self.att(tok, tok, tok, key_padding_mask=missing, need_weights=False)
        keep = (~missing).unsqueeze(-1).to(h.dtype)
        return self.head((h * keep).sum(1) / keep.sum(1))


def make_channel_attention() -> ChannelAttentionNet:
    torch.manual_seed(0)
    return ChannelAttentionNet()


# ---------------------------------------------------------------------------------------------
# log-amplitude spectra of learned spatial filters


class SpectralNet(nn.Module):
    """A learnable spatial filter (CSP-like, no offset), the STFT of each virtual channel, its
    amplitude by hand and the log of it floored at 1e-6, averaged over frames, then an MLP."""

    def __init__(self, n_chans: int = N_CHANS, n_filters: int = 6, n_fft: int = 32,
                 n_classes: int = N_CLASSES, by_abs: bool = False):
        super().__init__()
        self.by_abs = by_abs
        self.spatial = nn.Linear(n_chans, n_filters, bias=False)
        self.register_buffer("window", torch.hann_window(n_fft))
        self.n_fft = n_fft
        self.head = nn.Sequential(nn.Linear(n_filters * (n_fft // 2 + 1), 32), nn.ReLU(),
                                  nn.Linear(32, n_classes))

    def forward(self, x):  # (B, C, T)
        b = x.shape[0]
        v = self.spatial(x.transpose(1, 2)).transpose(1, 2).reshape(-1, x.shape[-1])
        spec = torch.stft(v, self.n_fft, self.n_fft // 2, window=self.window, center=False,
                          return_complex=True)
        if self.by_abs:
            amp = spec.abs()
        else:
            amp = (spec.real ** 2 + spec.imag ** 2).sqrt()  # the bug: sqrt'(0) = inf
        logamp = torch.log(amp.clamp_min(1e-6)).mean(-1)
        return self.head(logamp.reshape(b, -1))


def make_spectral() -> SpectralNet:
    torch.manual_seed(0)
    return SpectralNet()


def make_spectral_abs() -> SpectralNet:
    torch.manual_seed(0)
    return SpectralNet(by_abs=True)


# ---------------------------------------------------------------------------------------------
# relative band powers from the FFT

BANDS = ((4.0, 8.0), (8.0, 13.0), (13.0, 30.0), (30.0, 45.0))  # theta, alpha, beta, gamma


class RelativeBandPower(nn.Module):
    """Learned spatial filters (no offset), each filtered signal's periodogram by
    ``torch.fft.rfft``, its power in the classic bands relative to the total, log-ratio
    features and a linear head (the hand-crafted features of sleep staging and BCI
    baselines, end to end)."""

    def __init__(self, n_chans: int = N_CHANS, n_filters: int = 6, n_classes: int = N_CLASSES):
        super().__init__()
        self.spatial = nn.Linear(n_chans, n_filters, bias=False)
        freqs = torch.fft.rfftfreq(N_TIMES, 1 / FS)
        self.register_buffer("bands", torch.stack([(freqs >= lo) & (freqs < hi)
                                                   for lo, hi in BANDS]).float())
        self.head = nn.Linear(n_filters * len(BANDS), n_classes)

    def forward(self, x):  # (B, C, T)
        v = self.spatial(x.transpose(1, 2)).transpose(1, 2)
        power = torch.fft.rfft(v, dim=-1).abs() ** 2
        rel = (power @ self.bands.T) / power.sum(-1, keepdim=True)  # the bug: 0/0, a blank trial
        return self.head(torch.log(rel).flatten(1))


def make_band_power() -> RelativeBandPower:
    torch.manual_seed(0)
    return RelativeBandPower()
