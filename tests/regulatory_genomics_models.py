"""Sequence-to-function models of regulatory genomics, as BPNet/ChromBPNet write them, for
``test_regulatory_genomics``.

- ``BPNet``: one-hot DNA ``(B, 4, L)``, a wide first conv, dilated residual convs (dilation
  doubling per layer), a profile head (a wide conv to per-base logits per track, cropped to the
  output window) and a total-count head (global average pool, a linear layer) predicting
  ``log(1 + total)`` per track. ``pwm_norm`` rescales each position's base channels to sum to 1
  first (a soft one-hot for ambiguous calls), as some loaders do inside the model.
- ``bpnet_loss``: the multinomial NLL of the profile (``log_softmax`` of the logits against the
  observed counts normalised by their total) plus a weighted MSE of the log total counts, with
  optional per-track weights; ``log1p`` or, the bug, ``log`` of the total.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SEQ, OUT, TRACKS = 160, 96, 2


class DilatedResidual(nn.Module):
    def __init__(self, channels: int, dilation: int):
        super().__init__()
        self.conv = nn.Conv1d(channels, channels, 3, padding=dilation, dilation=dilation)

    def forward(self, x):
        return x + F.relu(self.conv(x))


class BPNet(nn.Module):
    def __init__(self, channels: int = 16, layers: int = 4, pwm_norm: bool = False):
        super().__init__()
        self.stem = nn.Conv1d(4, channels, 11, padding=5)
        self.tower = nn.Sequential(*[DilatedResidual(channels, 2 ** (i + 1))
                                     for i in range(layers)])
        self.profile = nn.Conv1d(channels, TRACKS, 15, padding=7)
        self.count = nn.Linear(channels, TRACKS)
        self.pwm_norm = pwm_norm

    def forward(self, seq):
        if self.pwm_norm:  # each position's base channels as probabilities
            seq = seq / seq.sum(1, keepdim=True)
        h = self.tower(F.relu(self.stem(seq)))
        crop = (SEQ - OUT) // 2
        logits = self.profile(h)[..., crop:crop + OUT]  # (B, TRACKS, OUT)
        log_total = self.count(h.mean(-1))  # (B, TRACKS): log(1 + total counts)
        return logits, log_total


def make_bpnet() -> BPNet:
    torch.manual_seed(0)
    return BPNet()


def make_bpnet_pwm() -> BPNet:
    torch.manual_seed(0)
    return BPNet(pwm_norm=True)


def profile_nll(logits, counts, floor: float = 0.0):
    """Multinomial NLL per (sample, track): cross-entropy of the observed profile (counts over
    their total) against ``log_softmax`` of the logits; ``floor=1`` keeps a region with no read
    at a profile of 0 (a loss of 0), ``floor=0`` is the bug of 0/0 there."""
    total = counts.sum(-1, keepdim=True)
    profile = counts / (total.clamp_min(floor) if floor else total)
    return -(profile * F.log_softmax(logits, -1)).sum(-1)


class BPNetLoss(nn.Module):
    """Profile NLL plus ``count_weight`` times the MSE of log total counts; ``log1p=False`` is
    the bug of ``log(total)``, ``floor=0`` that of an unfloored profile total; ``track_weights`` (B-independent, per track) scale both."""

    def __init__(self, count_weight: float = 1.0, log1p: bool = True, floor: float = 1.0):
        super().__init__()
        self.count_weight, self.log1p, self.floor = count_weight, log1p, floor

    def forward(self, out, counts, track_weights=None):
        logits, log_total = out
        total = counts.sum(-1)
        target = torch.log1p(total) if self.log1p else torch.log(total)
        per_track = profile_nll(logits, counts, self.floor) + self.count_weight * (log_total - target) ** 2
        if track_weights is not None:
            per_track = per_track * track_weights
        return per_track.mean()


# ---------------------------------------------------------------------------------------------
# data


def one_hot(g: torch.Generator, n: int) -> torch.Tensor:
    idx = torch.randint(0, 4, (n, SEQ), generator=g)
    return F.one_hot(idx, 4).transpose(1, 2).float()


def reverse_complement(seq, counts):
    """ACGT reversed and complemented; the profile's strands flipped and reversed."""
    return seq.flip(1).flip(2), counts.flip(1).flip(2)


def peak_batch(g: torch.Generator, n: int = 8, empty: tuple[int, int] | None = None,
               n_run: int | None = None, empty_track: int | None = None):
    """One-hot sequences and per-base read counts ``(B, TRACKS, OUT)``. ``empty``: (sample,
    track) of a region with no read in that track; ``n_run``: a sample with a run of N bases
    (all-zero one-hot columns); ``empty_track``: a track with no read in any region of the
    batch (a failed replicate)."""
    seq = one_hot(g, n)
    counts = torch.poisson(torch.rand(n, TRACKS, OUT, generator=g) * 4, generator=g)
    if empty is not None:
        counts[empty] = 0.0
    if n_run is not None:
        seq[n_run, :, 40:52] = 0.0
    if empty_track is not None:
        counts[:, empty_track] = 0.0
    return seq, counts


# ---------------------------------------------------------------------------------------------
# Basenji: binned coverage under a Poisson NLL


class Basenji(nn.Module):
    """Conv blocks with max pooling down to 8-bp bins, dilated residual convs, a softplus head:
    per-bin coverage rates ``(B, bins, TRACKS)``."""

    def __init__(self, channels: int = 16):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv1d(4, channels, 7, padding=3), nn.GELU(), nn.MaxPool1d(2),
                                  nn.Conv1d(channels, channels, 5, padding=2), nn.GELU(),
                                  nn.MaxPool1d(4))
        self.tower = nn.Sequential(DilatedResidual(channels, 2), DilatedResidual(channels, 4))
        self.head = nn.Linear(channels, TRACKS)

    def forward(self, seq):
        h = self.tower(self.stem(seq)).transpose(1, 2)  # (B, bins, C)
        return F.softplus(self.head(h))


def make_basenji() -> Basenji:
    torch.manual_seed(0)
    return Basenji()


def make_basenji_drifted() -> Basenji:
    """A checkpoint trained long on a track with no coverage: its head's bias for that track
    pushed far negative (the Poisson loss keeps lowering a rate whose target is 0)."""
    model = make_basenji()
    with torch.no_grad():
        model.head.bias[1] = -120.0
    return model


def poisson_nll(rate, target):
    """Poisson NLL on rates (``log_input=False``) written out, without an eps in the log."""
    return (rate - target * torch.log(rate)).mean()


def poisson_nll_eps(rate, target):
    return F.poisson_nll_loss(rate, target, log_input=False)


def binned(counts: torch.Tensor, width: int = 8) -> torch.Tensor:
    """Base-resolution counts ``(B, TRACKS, L)`` summed into bins ``(B, L / width, TRACKS)``."""
    return counts.unflatten(-1, (-1, width)).sum(-1).transpose(1, 2)


def coverage_batch(g: torch.Generator, n: int = 8, **bad):
    seq, counts = peak_batch(g, n, **bad)
    full = torch.poisson(torch.rand(n, TRACKS, SEQ, generator=g) * 4, generator=g)
    if bad.get("empty_track") is not None:
        full[:, bad["empty_track"]] = 0.0
    return seq, binned(full)


# ---------------------------------------------------------------------------------------------
# ChromBPNet: a frozen bias model's logits added to the main model's


class ChromBPNet(nn.Module):
    """Bias-factorised: the Tn5 bias model (trained first, frozen) and the main BPNet; profile
    logits add, total counts add in count space (``logsumexp`` of the log totals). The bias
    model was trained under ``log_softmax``, which leaves its logits' offset free: it drifted to
    ``offset``."""

    def __init__(self, offset: float = 0.0):
        super().__init__()
        self.bias = BPNet(channels=8, layers=2)
        self.main = BPNet()
        with torch.no_grad():
            self.bias.profile.bias += offset
        self.bias.requires_grad_(False)

    def forward(self, seq):
        b_logits, b_total = self.bias(seq)
        logits, total = self.main(seq)
        return logits + b_logits, torch.logaddexp(total, b_total)


def make_chrombpnet() -> ChromBPNet:
    torch.manual_seed(0)
    return ChromBPNet(offset=12.0).half()


def softmax_profile_nll(logits, counts):
    """The profile NLL written with exp / sum: the probabilities, then their log."""
    e = torch.exp(logits)
    probs = e / e.sum(-1, keepdim=True)
    profile = counts / counts.sum(-1, keepdim=True).clamp_min(1)
    return -(profile * torch.log(probs)).sum(-1)


def chrombpnet_loss(out, counts):
    logits, log_total = out
    target = torch.log1p(counts.sum(-1))
    return (softmax_profile_nll(logits, counts) + (log_total - target) ** 2).mean()


class MaskedBPNetLoss(BPNetLoss):
    """The profile NLL over mappable positions only: the blacklisted ones' logits filled with
    -inf before ``log_softmax`` (their reads are 0). ``zero_masked``: their log-probabilities
    set to 0 after it; without it, 0 reads times a log-probability of -inf is NaN."""

    def __init__(self, zero_masked: bool = True):
        super().__init__()
        self.zero_masked = zero_masked

    def forward(self, out, counts, unmappable):
        logits, log_total = out
        logp = F.log_softmax(logits.masked_fill(unmappable, float("-inf")), -1)
        if self.zero_masked:
            logp = logp.masked_fill(unmappable, 0.0)
        total = counts.sum(-1)
        nll = -(counts * logp).sum(-1) / total.clamp_min(1)
        return (nll + (log_total - torch.log1p(total)) ** 2).mean()


def unmappable_mask(n: int, width: int = 6) -> torch.Tensor:
    """Blacklisted positions (a repeat no read maps to) at the same place in every region."""
    mask = torch.zeros(n, TRACKS, OUT, dtype=torch.bool)
    mask[..., 30:30 + width] = True
    return mask


def poisson_nll_no_eps(rate, target):
    """``F.poisson_nll_loss`` on rates with its eps set to 0 (meant as 'off')."""
    return F.poisson_nll_loss(rate, target, log_input=False, eps=0.0)


def make_chrombpnet_fp32() -> ChromBPNet:
    torch.manual_seed(0)
    return ChromBPNet(offset=12.0)
