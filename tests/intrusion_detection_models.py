"""Network intrusion detection on flow records, written as CIC-IDS2017 / UNSW-NB15 baselines
write it: per-flow byte and packet counts and a duration, the rate ``bytes / duration`` the
CSV export carries (inf for a zero-duration flow), ``log1p`` of the heavy-tailed counts, a
z-score with per-column statistics of the training split, a one-hot protocol; an MLP trained
with a class-balanced focal loss (effective number ``(1 - beta^n) / (1 - beta)`` per class,
one class absent from the training split), a flow autoencoder whose reconstruction error is
the anomaly score (a temperatured sigmoid around a threshold, a hand-written BCE), and a GRU
over the packets of a flow with a padding mask and mean + std pooling (x-vector style).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

COLS = ("fwd_bytes", "bwd_bytes", "fwd_pkts", "bwd_pkts", "duration", "rate")
NUM = len(COLS)
PROTOS = 3             # tcp, udp, icmp (one-hot)
CLASSES = 4            # benign, dos, portscan, infiltration
COUNTS = (9000.0, 700.0, 300.0, 0.0)   # training split: no infiltration flow in it
PKTS, PKT_FEATS = 8, 2                 # packets kept per flow; size, inter-arrival time


def flows(g: torch.Generator, labels: torch.Tensor, icmp: bool = True):
    """Raw flow records ``(n, NUM)`` as the CSV gives them and the one-hot protocol
    ``(n, PROTOS)``: DoS flows are short and fat, port scans tiny; ``icmp=False``: a split
    with the ICMP flows filtered out (column 2 of the one-hot never 1)."""
    n = labels.numel()
    lab = labels.float()
    pkts = torch.exp(torch.randn(n, 2, generator=g) + 2 + lab[:, None] * 0.5).round() + 1
    size = 60 + 900 * torch.rand(n, 2, generator=g)
    byts = (pkts * size).round()
    dur = torch.exp(torch.randn(n, generator=g) * 2 - 2 * (lab == 1).float()) + 1e-3
    rate = byts.sum(1) / dur
    num = torch.cat([byts, pkts, dur[:, None], rate[:, None]], dim=1)
    proto = torch.randint(0, PROTOS if icmp else PROTOS - 1, (n,), generator=g)
    return num, F.one_hot(proto, PROTOS).float()


def packets(g: torch.Generator, n: int, lengths: torch.Tensor):
    """Per-packet ``(size, inter-arrival)`` ``(n, PKTS, 2)`` zero-padded after ``lengths``,
    and the padding mask ``(n, PKTS)`` (True: a real packet)."""
    x = torch.stack([torch.rand(n, PKTS, generator=g) * 1.5,
                     torch.rand(n, PKTS, generator=g)], dim=-1)
    mask = torch.arange(PKTS)[None] < lengths[:, None]
    return x * mask[..., None], mask


def train_stats(num: torch.Tensor, log: bool = True):
    """Per-column mean and std of the (log1p-scaled) training split."""
    x = torch.log1p(num) if log else num
    return x.mean(0), x.std(0)


class FlowScaler(nn.Module):
    """``log1p`` of the counts (``log=False``: forgotten), then the z-score with the training
    split's per-column statistics as buffers; ``eps`` in the divisor."""

    def __init__(self, mean, std, log: bool = True, eps: float = 1e-6):
        super().__init__()
        self.log, self.eps = log, eps
        self.register_buffer("mean", mean.clone())
        self.register_buffer("std", std.clone())

    def forward(self, num):
        x = torch.log1p(num) if self.log else num
        return (x - self.mean) / (self.std + self.eps)


class Detector(nn.Module):
    """Scaled flow features beside the one-hot protocol, an MLP, class logits."""

    def __init__(self, mean, std, log: bool = True, eps: float = 1e-6):
        super().__init__()
        self.scale = FlowScaler(mean, std, log, eps)
        self.fc1 = nn.Linear(NUM + PROTOS, 32)
        self.fc2 = nn.Linear(32, CLASSES)

    def forward(self, num, proto):
        h = torch.relu(self.fc1(torch.cat([self.scale(num), proto], dim=-1)))
        return self.fc2(h)


class FlowAE(nn.Module):
    """Autoencoder over the scaled features; returns the per-flow anomaly probability
    ``sigmoid((err - tau) / temp)`` of its mean squared reconstruction error."""

    def __init__(self, mean, std, tau: float = 5.0, temp: float = 0.01):
        super().__init__()
        self.scale = FlowScaler(mean, std)
        self.enc = nn.Linear(NUM, 3)
        self.dec = nn.Linear(3, NUM)
        self.tau, self.temp = tau, temp

    def forward(self, num):
        x = self.scale(num)
        err = ((self.dec(torch.tanh(self.enc(x))) - x) ** 2).mean(-1)
        return torch.sigmoid((err - self.tau) / self.temp)


class PacketGRU(nn.Module):
    """A GRU over a flow's packets, mean and std of its states over the real packets (the
    padding mask), a linear head. ``floor``: the variance floored before the sqrt (the fix)."""

    def __init__(self, floor: float = 0.0):
        super().__init__()
        self.gru = nn.GRU(PKT_FEATS, 16, batch_first=True)
        self.head = nn.Linear(32, CLASSES)
        self.floor = floor

    def forward(self, pkts, mask):
        h, _ = self.gru(pkts)
        m = mask[..., None].float()
        n = m.sum(1)
        mu = (h * m).sum(1) / n
        var = (((h - mu[:, None]) ** 2) * m).sum(1) / n
        if self.floor:
            var = var.clamp_min(self.floor)
        return self.head(torch.cat([mu, torch.sqrt(var)], dim=-1))


class ClassBalancedFocal(nn.Module):
    """Cui et al.'s class-balanced focal loss on soft targets (mixup): weights ``1 / E_n``
    with ``E_n = (1 - beta^n) / (1 - beta)``, normalised to sum to the number of classes.
    ``min_count``: counts floored (the fix for a class absent from the split)."""

    def __init__(self, counts=COUNTS, beta: float = 0.999, gamma: float = 2.0,
                 min_count: float = 0.0):
        super().__init__()
        self.beta, self.gamma = beta, gamma
        self.register_buffer("counts", torch.tensor(counts).clamp_min(min_count))

    def forward(self, logits, target):
        eff = (1 - self.beta ** self.counts) / (1 - self.beta)
        w = 1.0 / eff
        w = w / w.sum() * CLASSES
        logp = F.log_softmax(logits, dim=-1)
        focal = (1 - logp.exp()) ** self.gamma
        return -(w * target * focal * logp).sum(-1).mean()


class AnomalyBCE(nn.Module):
    """Binary cross-entropy written out on the autoencoder's anomaly probability."""

    def forward(self, p, y):
        return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()


_G = torch.Generator().manual_seed(1)
_MEAN, _STD = train_stats(flows(_G, torch.zeros(512, dtype=torch.long))[0])
_RAW_MEAN, _RAW_STD = train_stats(flows(_G, torch.zeros(512, dtype=torch.long))[0], log=False)
_CONST_STD = _STD.clone()
_CONST_STD[5] = 0.0    # a column constant over the split (CIC-IDS2017's Bwd PSH Flags)


def make_detector():
    torch.manual_seed(0)
    return Detector(_MEAN, _STD)


def make_detector_raw():
    """The counts z-scored without ``log1p``."""
    torch.manual_seed(0)
    return Detector(_RAW_MEAN, _RAW_STD, log=False)


def make_detector_const():
    """A column whose training std is 0, z-scored with ``eps=0``."""
    torch.manual_seed(0)
    return Detector(_MEAN, _CONST_STD, eps=0.0)


def make_ae():
    torch.manual_seed(0)
    return FlowAE(_MEAN, _STD)


def make_ae_wide():
    """The anomaly temperature at 1 (no underflow)."""
    torch.manual_seed(0)
    return FlowAE(_MEAN, _STD, temp=1.0)


def make_gru():
    torch.manual_seed(0)
    return PacketGRU()


def make_gru_floor():
    torch.manual_seed(0)
    return PacketGRU(floor=1e-6)
