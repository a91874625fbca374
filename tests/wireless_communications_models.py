"""Deep learning for the physical layer, written as Sionna's tutorials, O'Shea & Hoydis'
autoencoder and the DeepMIMO/ChannelNet estimators write it: an end-to-end transceiver with
a power-normalisation layer and an AWGN channel fed Eb/N0 in dB, a residual CNN refining
OFDM least-squares channel estimates under an NMSE loss (guard and DC subcarriers nulled),
an LMMSE MIMO detector on ``torch.complex64`` followed by a neural demapper fed the noise
variance ``no``, and a neural equaliser whose demapper computes the LLRs over a 16-QAM
constellation (by hand, ``log(sum(exp(-d / no)))``, or with ``logsumexp`` and a ``-inf`` mask
over the points a QPSK sample does not use)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

K_BITS, N_CH = 8, 8              # autoencoder: bits per block, complex channel uses
N_SC, GUARD = 32, 4              # OFDM: subcarriers, guard subcarriers at each edge
N_RX, N_TX = 4, 2                # MIMO antennas


# -- end-to-end autoencoder ------------------------------------------------------------------

class PowerNorm(nn.Module):
    """Unit average power per block, ``x / sqrt(mean(x^2))``; ``eps`` as the fixed version."""

    def __init__(self, eps: float = 0.0):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        return x / torch.sqrt(x.pow(2).mean(dim=1, keepdim=True) + self.eps)


class AWGN(nn.Module):
    """The channel inside the model: noise std per real dimension from Eb/N0 in dB."""

    def forward(self, x, ebno_db, rate: float):
        ebno = 10 ** (ebno_db / 10)
        std = torch.sqrt(1.0 / (2 * rate * ebno))
        return x + std[:, None] * torch.randn_like(x)


class Autoencoder(nn.Module):
    """Bits in, bit logits out. The encoder is linear without biases (a learned linear code
    with an ELU between), so it maps the all-zero block to the all-zero signal."""

    def __init__(self, eps: float = 0.0):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(K_BITS, 32, bias=False), nn.ELU(),
                                     nn.Linear(32, 2 * N_CH, bias=False))
        self.norm = PowerNorm(eps)
        self.channel = AWGN()
        self.decoder = nn.Sequential(nn.Linear(2 * N_CH, 64), nn.ReLU(), nn.Linear(64, K_BITS))

    def forward(self, bits, ebno_db):
        x = self.norm(self.encoder(bits))
        return self.decoder(self.channel(x, ebno_db, rate=K_BITS / N_CH))


def make_autoencoder() -> nn.Module:
    torch.manual_seed(0)
    return Autoencoder()


def make_autoencoder_eps() -> nn.Module:
    torch.manual_seed(0)
    return Autoencoder(eps=1e-9)


class ComplexPowerNorm(nn.Module):
    """Unit average power per block of complex symbols, ``z / sqrt(mean(|z|^2))``."""

    def forward(self, z):
        return z / torch.sqrt(torch.mean(z.abs() ** 2, dim=1, keepdim=True))


class RayleighAutoencoder(nn.Module):
    """A complex64 linear code (``nn.Linear(dtype=torch.cfloat)``, no bias) over a block-fading
    Rayleigh channel ``y = h x + n`` inside the model, equalised with the known ``h``."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(K_BITS, N_CH, bias=False, dtype=torch.cfloat)
        self.norm = ComplexPowerNorm()
        self.decoder = nn.Sequential(nn.Linear(2 * N_CH, 64), nn.ReLU(), nn.Linear(64, K_BITS))

    def forward(self, bits, ebno_db):
        x = self.norm(self.encoder(bits.to(torch.cfloat)))
        h = torch.randn(x.shape[0], 1, dtype=torch.cfloat)
        no = 1.0 / (K_BITS / N_CH * 10 ** (ebno_db / 10))
        y = h * x + torch.randn_like(x) * torch.sqrt(no)[:, None]
        return self.decoder(torch.view_as_real(y * h.conj() / h.abs() ** 2).flatten(1))


def make_rayleigh_autoencoder() -> nn.Module:
    torch.manual_seed(0)
    return RayleighAutoencoder()


def bit_blocks(g: torch.Generator, n: int, padded: int | None = None):
    """Random bit blocks and Eb/N0 in dB; the block ``padded`` is the zero padding a file's
    last frame gets."""
    bits = torch.randint(0, 2, (n, K_BITS), generator=g).float()
    if padded is not None:
        bits[padded] = 0
    return bits, torch.empty(n).uniform_(0, 8, generator=g)


# -- OFDM channel estimation -----------------------------------------------------------------

class ResBlock(nn.Module):
    def __init__(self, ch: int):
        super().__init__()
        self.conv1 = nn.Conv1d(ch, ch, 3, padding=1)
        self.conv2 = nn.Conv1d(ch, ch, 3, padding=1)

    def forward(self, x):
        return x + self.conv2(F.relu(self.conv1(x)))


class ChannelEstimator(nn.Module):
    """ReEsNet-style refinement of the interpolated LS estimate ``(B, 2, N_SC)`` (re, im);
    the guard band and the DC subcarrier carry nothing, so their estimate is zeroed."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Conv1d(2, 16, 3, padding=1)
        self.blocks = nn.Sequential(ResBlock(16), ResBlock(16))
        self.out = nn.Conv1d(16, 2, 3, padding=1)
        active = torch.ones(N_SC)
        active[:GUARD], active[-GUARD:], active[N_SC // 2] = 0, 0, 0
        self.register_buffer("active", active)

    def forward(self, h_ls):
        return (h_ls + self.out(self.blocks(self.inp(h_ls)))) * self.active


class NormalizedEstimator(ChannelEstimator):
    """Normalises each frame by its measured power, ``10 log10(mean |h_ls|^2)`` in dB, and
    gives the estimator that level as a feature channel (an AGC before the network)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Conv1d(3, 16, 3, padding=1)

    def forward(self, h_ls):
        p_db = 10 * torch.log10(h_ls.pow(2).mean(dim=(1, 2), keepdim=True))
        x = h_ls * 10 ** (-p_db / 20)
        feats = torch.cat([x, (p_db / 10).expand(-1, 1, N_SC)], dim=1)
        return (x + self.out(self.blocks(self.inp(feats)))) * 10 ** (p_db / 20) * self.active


def make_estimator_agc() -> nn.Module:
    torch.manual_seed(0)
    return NormalizedEstimator()


def make_estimator() -> nn.Module:
    torch.manual_seed(0)
    return ChannelEstimator()


class NMSELoss(nn.Module):
    """Per-sample NMSE ``||h - h_hat||^2 / ||h||^2``, averaged over the batch."""

    def forward(self, h_hat, h):
        err = (h - h_hat).pow(2).sum(dim=(1, 2))
        return (err / h.pow(2).sum(dim=(1, 2))).mean()


class NMSEAmplitudeLoss(NMSELoss):
    """NMSE plus a term on the amplitude response ``|H(f)|``, the magnitude written with the
    real and imaginary parts (the bug: ``sqrt`` at a nulled subcarrier's exact 0)."""

    def forward(self, h_hat, h):
        amp_hat = torch.sqrt(h_hat[:, 0] ** 2 + h_hat[:, 1] ** 2)
        amp = torch.sqrt(h[:, 0] ** 2 + h[:, 1] ** 2)
        return super().forward(h_hat, h) + 0.1 * F.mse_loss(amp_hat, amp)


class ComplexAmplitudeLoss(NMSELoss):
    """The same amplitude term through ``torch.complex64``'s ``abs``, whose gradient at 0 is 0."""

    def forward(self, h_hat, h):
        amp_hat = torch.view_as_complex(h_hat.transpose(1, 2).contiguous()).abs()
        amp = torch.view_as_complex(h.transpose(1, 2).contiguous()).abs()
        return super().forward(h_hat, h) + 0.1 * F.mse_loss(amp_hat, amp)


def ofdm_batch(g: torch.Generator, n: int, no_path: int | None = None,
               muted: int | None = None):
    """(LS estimate, true channel) of ``n`` users: a 4-tap Rayleigh channel's frequency
    response, zero on the guard band and DC. The user ``no_path`` has no propagation path in
    the ray-traced scenario (DeepMIMO's all-zero channel), so only noise is received; the
    frame ``muted`` was dropped by the front end and zero-filled."""
    taps = torch.randn(n, 4, 2, generator=g) * 0.5
    f = torch.arange(N_SC)[:, None] * torch.arange(4)[None, :]
    w = torch.exp(-2j * math.pi * f / N_SC).to(torch.complex64)
    h = torch.einsum("ft,nt->nf", w, torch.view_as_complex(taps))
    h = torch.view_as_real(h).transpose(1, 2).contiguous()
    active = torch.ones(N_SC)
    active[:GUARD], active[-GUARD:], active[N_SC // 2] = 0, 0, 0
    h = h * active
    if no_path is not None:
        h[no_path] = 0
    h_ls = h + 0.1 * torch.randn(h.shape, generator=g) * active
    if muted is not None:
        h_ls[muted] = 0
    return h_ls, h


class SNRAwareEstimator(ChannelEstimator):
    """Estimates each frame's SNR from the received grid, the noise power from the guard
    band's bins (which carry noise only), and gives ``10 log10(snr)`` as a feature channel."""

    def __init__(self, clamp: bool = True):
        super().__init__()
        self.inp = nn.Conv1d(3, 16, 3, padding=1)
        self.clamp = clamp

    def forward(self, y):
        no_hat = y[:, :, :GUARD].pow(2).mean(dim=(1, 2))
        snr_db = 10 * torch.log10(y.pow(2).mean(dim=(1, 2)) / no_hat - 1)
        if self.clamp:  # (the range the model trains on; a noiseless frame's +inf to 40)
            snr_db = snr_db.clamp(-10, 40)
        feats = torch.cat([y, (snr_db / 10)[:, None, None].expand(-1, 1, N_SC)], dim=1)
        return (y + self.out(self.blocks(self.inp(feats)))) * self.active


def make_estimator_snr() -> nn.Module:
    torch.manual_seed(0)
    return SNRAwareEstimator()


def make_estimator_snr_unclamped() -> nn.Module:
    torch.manual_seed(0)
    return SNRAwareEstimator(clamp=False)


def ofdm_received(g: torch.Generator, n: int, noiseless: int | None = None):
    """(received grid divided by the pilots, true channel): noise on every bin, the guard
    band's included, at 0 to 20 dB; the frame ``noiseless`` comes from a noise-free
    simulation (the config's ``snr_db = inf``)."""
    h_ls, h = ofdm_batch(g, n)
    std = 10 ** (-torch.empty(n, 1, 1).uniform_(0, 20, generator=g) / 20)
    if noiseless is not None:
        std[noiseless] = 0
    return h + std * torch.randn(h.shape, generator=g) / math.sqrt(2), h


# -- MIMO detection --------------------------------------------------------------------------

class LMMSEDetector(nn.Module):
    """``x_hat = (H^H H + no I)^-1 H^H y`` and the post-equalisation noise variance per stream,
    ``no * diag((H^H H + no I)^-1)`` (no parameters)."""

    def forward(self, y, h, no):
        eye = torch.eye(h.shape[-1], dtype=h.dtype)
        hh = h.mH
        g_inv = torch.linalg.inv(hh @ h + no[:, None, None] * eye)
        x_hat = (g_inv @ hh @ y[..., None]).squeeze(-1)
        no_eff = no[:, None] * torch.diagonal(g_inv, dim1=-2, dim2=-1).real
        return x_hat, no_eff


class MIMOReceiver(nn.Module):
    """LMMSE, QPSK max-log LLRs ``2 sqrt(2) x / no_eff`` (the bug: ``no_eff`` is 0 for a
    noiseless sample), then a neural demapper refining them."""

    def __init__(self, residual: bool = False):
        super().__init__()
        self.detector = LMMSEDetector()
        self.demapper = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 2))
        self.residual = residual  # (a correction added to the max-log LLRs)

    def forward(self, y, h, no):
        x_hat, no_eff = self.detector(y, h, no)
        llr = 2 * math.sqrt(2) * torch.view_as_real(x_hat) / no_eff[..., None]
        out = self.demapper(llr)
        return (llr + out if self.residual else out).flatten(1)


class BitwiseBCE(nn.Module):
    """Bit-wise cross-entropy written from the soft bits ``sigmoid(llr)`` (bit 0 positive)."""

    def forward(self, llr, bits):
        p = torch.sigmoid(llr)
        return -(bits * torch.log(p) + (1 - bits) * torch.log(1 - p)).mean()


def make_mimo() -> nn.Module:
    torch.manual_seed(0)
    return MIMOReceiver()


def make_mimo_residual() -> nn.Module:
    torch.manual_seed(0)
    return MIMOReceiver(residual=True)


def mimo_batch(g: torch.Generator, n: int, snr_db: torch.Tensor, one_user: int | None = None):
    """Rayleigh channels, QPSK bits, received signals; ``no = 10 ** (-snr_db / 10)`` per
    sample, as the data pipeline converts the config's SNR (``inf``: noiseless). The sample
    ``one_user`` has a single user, its channel matrix zero-padded to ``N_TX`` columns."""
    h = torch.view_as_complex(torch.randn(n, N_RX, N_TX, 2, generator=g) / math.sqrt(2))
    if one_user is not None:
        h[one_user, :, 1:] = 0
    bits = torch.randint(0, 2, (n, N_TX, 2), generator=g).float()
    x = torch.view_as_complex((1 - 2 * bits) / math.sqrt(2))
    no = 10 ** (-snr_db / 10)
    noise = torch.view_as_complex(torch.randn(n, N_RX, 2, generator=g))
    noise = noise * torch.sqrt(no / 2)[:, None]
    y = (h @ x[..., None]).squeeze(-1) + noise
    return (y, h, no), (1 - bits).flatten(1)   # bit 0 maps to +1: a positive LLR


# -- neural equaliser with a 16-QAM demapper -------------------------------------------------

def qam16() -> tuple[torch.Tensor, torch.Tensor]:
    """Gray-labelled 16-QAM points (unit energy, complex64) and their bit labels ``(16, 4)``."""
    gray = torch.tensor([[0, 0], [0, 1], [1, 1], [1, 0]]).float()
    level = torch.tensor([-3.0, -1.0, 1.0, 3.0]) / math.sqrt(10)
    pts = torch.complex(level[:, None].expand(4, 4), level[None, :].expand(4, 4)).flatten()
    labels = torch.cat([gray[:, None].expand(4, 4, 2), gray[None, :].expand(4, 4, 2)], -1)
    return pts, labels.reshape(16, 4)


class Demapper(nn.Module):
    """Exact LLRs ``log sum_{b=1} exp(-|y - s|^2 / no) - log sum_{b=0} ...`` (bit 1 positive),
    by hand or with ``logsumexp`` over the points whose bit is 1 (the others filled ``-inf``)."""

    def __init__(self, logsumexp: bool):
        super().__init__()
        pts, labels = qam16()
        self.register_buffer("points", pts)
        self.register_buffer("labels", labels)
        self.logsumexp = logsumexp

    def forward(self, x_hat, no):
        d = (x_hat[..., None] - self.points).abs() ** 2 / no[:, None, None]   # (B, S, 16)
        if self.logsumexp:
            e = (-d)[..., None]                                                # (B, S, 16, 1)
            one = e.masked_fill(self.labels == 0, float("-inf")).logsumexp(-2)
            zero = e.masked_fill(self.labels == 1, float("-inf")).logsumexp(-2)
            return one - zero
        p = torch.exp(-d)
        return torch.log(p @ self.labels) - torch.log(p @ (1 - self.labels))


class NeuralEqualizer(nn.Module):
    """Per-symbol MLP equaliser for a flat-fading channel: ``(y, h)`` to ``x_hat``."""

    def __init__(self, logsumexp: bool):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 2))
        self.demapper = Demapper(logsumexp)

    def forward(self, y, h, no):
        feats = torch.cat([torch.view_as_real(y), torch.view_as_real(h)], -1)
        x_hat = torch.view_as_complex(self.mlp(feats).contiguous())
        return self.demapper(x_hat, no).flatten(1)


def make_equalizer() -> nn.Module:
    torch.manual_seed(0)
    return NeuralEqualizer(logsumexp=False)


def make_equalizer_lse() -> nn.Module:
    torch.manual_seed(0)
    return NeuralEqualizer(logsumexp=True)


def qam_batch(g: torch.Generator, n: int, snr_db: torch.Tensor, symbols: int = 6):
    """16-QAM symbols over flat Rayleigh fading: ``(y, h, no)`` and the bits."""
    pts, labels = qam16()
    idx = torch.randint(0, 16, (n, symbols), generator=g)
    h = torch.view_as_complex(torch.randn(n, symbols, 2, generator=g) / math.sqrt(2))
    no = 10 ** (-snr_db / 10)
    noise = torch.view_as_complex(torch.randn(n, symbols, 2, generator=g))
    y = h * pts[idx] + noise * torch.sqrt(no / 2)[:, None]
    return (y, h, no), labels[idx].flatten(1)
