"""Cryo-EM heterogeneous reconstruction as cryoDRGN writes it, for ``test_cryo_em_reconstruction``.

``CryoVAE``: each particle image is normalised by its own std, CTF-corrected by a Wiener filter
in Fourier space (``rfft2``/``irfft2``, ``F * ctf / (ctf^2 + 1/SNR)``) and encoded by an MLP to
a latent ``z`` (reparameterised, KL term); the decoder is a coordinate network (Gaussian
Fourier features of 3-D coordinates, an MLP) evaluated on the central slice rotated by each
particle's pose, a quaternion from the pose search normalised into a rotation matrix (the
Fourier slice theorem); the slice times the particle's CTF (defocus from the STAR file as
``log`` of Å, spherical aberration, amplitude contrast) is compared with the image's
symmetrised Hartley transform (``fft2`` + ``fftshift``, ``real - imag``); optionally
per-particle axis-angle pose corrections (Rodrigues' formula, an embedding started at 0).
``RefineCTF``: per-particle defocus refinement, an embedding of log(Å) loaded from the STAR
file. ``CTFNet``: a learned CTF estimator over the log power (or amplitude) spectrum of
counting-mode patches.
``PoseMarginal``: local refinement marginalising over candidate poses, those outside the
particle's search window masked to -inf before the loss's logsumexp.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

D = 8  # box size in pixels
APIX = 4.0  # Å per pixel


def quat_to_rot(q, eps: float = 0.0):
    """Rotation matrices of quaternions (w, x, y, z), normalised by their norm."""
    q = q / (q.norm(dim=-1, keepdim=True) + eps)  # the bug at eps=0: a zero quaternion, 0/0
    w, x, y, z = q.unbind(-1)
    return torch.stack([
        1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w),
        2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w),
        2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)], -1).view(-1, 3, 3)


def so3_exp(v, eps: float = 1e-8):
    """Rodrigues' formula: the rotation of an axis-angle vector (the exp map of so(3))."""
    theta = torch.sqrt((v * v).sum(-1, keepdim=True))  # the bug: sqrt's gradient at 0 is inf
    k = v / (theta + eps)
    zero = torch.zeros_like(k[..., 0])
    kx, ky, kz = k.unbind(-1)
    K = torch.stack([zero, -kz, ky, kz, zero, -kx, -ky, kx, zero], -1).view(-1, 3, 3)
    s, c = torch.sin(theta)[..., None], torch.cos(theta)[..., None]
    return torch.eye(3, device=v.device) + s * K + (1 - c) * K @ K


def ctf_2d(freqs, defocus, volt: float = 300.0, cs: float = 2.7, w: float = 0.1):
    """cryoDRGN's ``compute_ctf``: freqs (..., 2) in 1/Å, defocus (B, 1) in Å."""
    volt, cs = volt * 1e3, cs * 1e7
    lam = 12.2643247 / math.sqrt(volt + 0.978466e-6 * volt ** 2)
    s2 = (freqs ** 2).sum(-1)
    gamma = 2 * math.pi * (-0.5 * defocus[..., None] * lam * s2
                           + 0.25 * cs * lam ** 3 * s2 ** 2)
    return math.sqrt(1 - w * w) * torch.sin(gamma) - w * torch.cos(gamma)


def normalise_particles(img, eps: float = 0.0):
    """Per-particle normalisation: zero mean, unit std."""
    mean = img.mean(dim=(-2, -1), keepdim=True)
    std = img.std(dim=(-2, -1), keepdim=True)
    return (img - mean) / (std + eps)  # the bug at eps=0: a blank crop's std is 0


def hartley(img):
    f = torch.fft.fftshift(torch.fft.fft2(img), dim=(-2, -1))
    return f.real - f.imag


class FourierFeatures(nn.Module):
    """Gaussian Fourier features of 3-D coordinates (a fixed random projection)."""

    def __init__(self, n: int = 16, sigma: float = 0.5):
        super().__init__()
        self.register_buffer("proj", torch.randn(3, n) * sigma)

    def forward(self, coords):
        x = 2 * math.pi * coords @ self.proj
        return torch.cat([torch.sin(x), torch.cos(x)], -1)


class Decoder(nn.Module):
    def __init__(self, zdim: int = 4, hidden: int = 32, nfeat: int = 16):
        super().__init__()
        self.ff = FourierFeatures(nfeat)
        self.mlp = nn.Sequential(nn.Linear(2 * nfeat + zdim, hidden), nn.ReLU(),
                                 nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, coords, z):
        h = torch.cat([self.ff(coords), z[:, None].expand(-1, coords.shape[1], -1)], -1)
        return self.mlp(h).squeeze(-1)


class Encoder(nn.Module):
    def __init__(self, zdim: int = 4, hidden: int = 32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(D * D, hidden), nn.ReLU(), nn.Linear(hidden, 2 * zdim))

    def forward(self, img):
        mu, logvar = self.net(img.flatten(1)).chunk(2, -1)
        return mu, logvar


class CryoVAE(nn.Module):
    def __init__(self, zdim: int = 4, eps: float = 1e-6, inv_snr: float = 0.1, w: float = 0.1,
                 log_defocus: bool = True, n_particles: int = 0):
        super().__init__()
        # per-particle pose corrections (axis-angle), refined from the identity
        self.pose_delta = nn.Embedding(n_particles, 3) if n_particles else None
        if n_particles:
            nn.init.zeros_(self.pose_delta.weight)
        self.encoder, self.decoder = Encoder(zdim), Decoder(zdim)
        self.eps, self.inv_snr, self.w, self.log_defocus = eps, inv_snr, w, log_defocus
        c = torch.arange(D) - D // 2
        gy, gx = torch.meshgrid(c, c, indexing="ij")
        # the central slice z = 0 in the fftshifted frame, coordinates in [-0.5, 0.5)
        self.register_buffer("lattice", torch.stack([gx, gy, 0 * gx], -1).view(-1, 3) / D)
        self.register_buffer("freqs", torch.stack([gx, gy], -1).float() / (D * APIX))
        ry = torch.fft.fftfreq(D, APIX)
        rx = torch.fft.rfftfreq(D, APIX)
        self.register_buffer("rfreqs", torch.stack(torch.meshgrid(rx, ry, indexing="xy"), -1))

    def wiener(self, img, defocus):
        """CTF correction of the encoder's input: F * ctf / (ctf^2 + 1/SNR)."""
        f = torch.fft.rfft2(img)
        ctf = ctf_2d(self.rfreqs, defocus, w=self.w)
        return torch.fft.irfft2(f * ctf / (ctf ** 2 + self.inv_snr), s=img.shape[-2:])

    def forward(self, img, quat, defocus, idx=None):
        img = normalise_particles(img, self.eps)
        if self.log_defocus:  # the STAR file's defocus kept as log(Å) in the dataset
            defocus = torch.exp(defocus)
        mu, logvar = self.encoder(self.wiener(img, defocus))
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)
        rot = quat_to_rot(quat, self.eps)
        if self.pose_delta is not None:
            rot = rot @ so3_exp(self.pose_delta(idx))
        coords = self.lattice @ rot  # the central slice rotated by the pose
        slice_ = self.decoder(coords, z).view(-1, D, D)
        pred = slice_ * ctf_2d(self.freqs, defocus, w=self.w)
        return pred, hartley(img), mu, logvar


def vae_loss(pred, target, mu, logvar, beta: float = 0.05):
    kld = -0.5 * torch.mean(torch.sum(1 + logvar - mu.pow(2) - logvar.exp(), -1))
    return F.mse_loss(pred, target) + beta * kld


def make_vae() -> CryoVAE:
    torch.manual_seed(0)
    return CryoVAE()


def make_vae_no_eps() -> CryoVAE:
    torch.manual_seed(0)
    return CryoVAE(eps=0.0)


def make_vae_no_noise() -> CryoVAE:
    """A Wiener filter told the data is noiseless (1/SNR = 0) and a phase-only CTF (w = 0):
    ctf is exactly 0 at the DC term of every image."""
    torch.manual_seed(0)
    return CryoVAE(inv_snr=0.0, w=0.0)


def make_vae_pose_refine() -> CryoVAE:
    torch.manual_seed(0)
    return CryoVAE(n_particles=32)


class RefineCTF(CryoVAE):
    """Per-particle CTF refinement: each particle's log defocus (Å) an embedding row the
    optimizer refines, initialised from the STAR file's values."""

    def __init__(self, star_log_df):
        super().__init__(log_defocus=False)
        self.log_df = nn.Embedding.from_pretrained(star_log_df, freeze=False)

    def forward(self, img, quat, defocus, idx):
        return super().forward(img, quat, torch.exp(self.log_df(idx)), idx)


def make_refine_ctf() -> RefineCTF:
    """The STAR file's row 29 holds its defocus in Å, not log(Å)."""
    torch.manual_seed(0)
    return RefineCTF(particles(raw_defocus=29).tensors[2].clone())


class CTFNet(nn.Module):
    """A learned CTF estimator: the log power spectrum of a counting-mode patch (integer
    electron counts, mean subtracted) to its log defocus."""

    def __init__(self, hidden: int = 32, eps: float = 0.0, mask: str = ""):
        super().__init__()
        self.eps, self.mask = eps, mask
        self.net = nn.Sequential(nn.Linear(D * (D // 2 + 1), hidden), nn.ReLU(),
                                 nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, counts):
        x = counts - counts.mean(dim=(-2, -1), keepdim=True)
        ps = torch.fft.rfft2(x).abs().pow(2)
        if self.mask == "dc":  # log(0) = -inf at the DC term dropped; other exact zeros kept
            logps = torch.log(ps)
            dc = torch.zeros_like(ps, dtype=torch.bool)
            dc[..., 0, 0] = True
            return self.net(torch.where(dc, 0.0, logps).flatten(1))
        if self.mask == "amplitude":  # the amplitude spectrum, not its log
            return self.net(torch.fft.rfft2(counts).abs().flatten(1))
        if self.mask == "zeros":  # every exact zero's -inf dropped: healthy
            return self.net(torch.where(ps > 0, torch.log(ps), 0.0).flatten(1))
        return self.net(torch.log(ps + self.eps).flatten(1))  # the bug at eps=0: DC is exactly 0


def make_ctfnet() -> CTFNet:
    torch.manual_seed(0)
    return CTFNet()


def make_ctfnet_dc_masked() -> CTFNet:
    torch.manual_seed(0)
    return CTFNet(mask="dc")


def make_ctfnet_masked() -> CTFNet:
    torch.manual_seed(0)
    return CTFNet(mask="zeros")


def make_ctfnet_amplitude() -> CTFNet:
    torch.manual_seed(0)
    return CTFNet(mask="amplitude")


def counting_patches(n: int = 32, seed: int = 0, adu: int | None = None):
    """Poisson electron counts (integer valued) and each patch's log defocus, centred;
    ``adu``: a patch from an integrating camera's micrograph, in ADU (about 1000 per
    electron), merged into the counting-mode data set without conversion."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.poisson(torch.full((n, D, D), 3.0), generator=g)
    if adu is not None:
        counts[adu] *= 1000.0
    return torch.utils.data.TensorDataset(counts, torch.randn(n, 1, generator=g))


def particles(n: int = 32, blank: int | None = None, zero_quat: int | None = None,
              raw_defocus: int | None = None, nan_pixel: int | None = None, seed: int = 0):
    """Noisy projections, pose-search quaternions and log-defocus (Å) of ``n`` particles;
    ``blank``: a crop at the micrograph's edge, all zeros; ``zero_quat``: a particle the pose
    initialiser left at (0, 0, 0, 0); ``raw_defocus``: a STAR row whose defocus was written in Å,
    not log(Å); ``nan_pixel``: a particle whose MRC crop holds a NaN pixel (a hot pixel a
    failed gain correction divided by 0)."""
    g = torch.Generator().manual_seed(seed)
    img = torch.randn(n, D, D, generator=g) + 2.0
    quat = torch.randn(n, 4, generator=g)
    log_df = torch.log(1e4 + 1.5e4 * torch.rand(n, generator=g))
    if blank is not None:
        img[blank] = 0.0
    if zero_quat is not None:
        quat[zero_quat] = 0.0
    if raw_defocus is not None:
        log_df[raw_defocus] = 15000.0
    if nan_pixel is not None:
        img[nan_pixel, 3, 3] = float("nan")
    return torch.utils.data.TensorDataset(img, quat, log_df[:, None], torch.arange(n))


class PoseMarginal(nn.Module):
    """Local pose marginalisation (RELION / cryoSPARC local refinement): the decoder's slice
    at each of K candidate poses, each candidate's log-likelihood of the image, candidates
    outside the angular window around the particle's prior pose masked to -inf."""

    def __init__(self, k: int = 6, window: float = 0.95, sigma: float = 1.0):
        super().__init__()
        self.vae = CryoVAE()
        g = torch.Generator().manual_seed(1)
        self.register_buffer("grid", F.normalize(torch.randn(k, 4, generator=g), dim=-1))
        self.window, self.sigma = window, sigma

    def forward(self, img, prior, defocus):
        img = normalise_particles(img, 1e-6)
        target, defocus = hartley(img), torch.exp(defocus)
        z = self.vae.encoder(self.vae.wiener(img, defocus))[0]
        ctf = ctf_2d(self.vae.freqs, defocus)
        rot = quat_to_rot(self.grid, 1e-6)  # (K, 3, 3)
        coords = (self.vae.lattice @ rot).flatten(0, 1)[None].expand(len(img), -1, -1)
        slices = self.vae.decoder(coords, z).view(len(img), len(rot), D, D)
        err = ((slices * ctf[:, None] - target[:, None]) ** 2).mean((-2, -1))
        logits = -err / (2 * self.sigma ** 2)
        near = (prior @ self.grid.T).abs() > self.window  # within the local search window
        return logits.masked_fill(~near, float("-inf"))


def marginal_nll(logits):
    return -torch.logsumexp(logits, -1).mean()


def make_pose_marginal() -> PoseMarginal:
    torch.manual_seed(0)
    return PoseMarginal()


def local_priors(n: int = 32, off_grid: int | None = None, seed: int = 0):
    """Particles whose prior pose is a grid pose jittered a little; ``off_grid``: a particle
    whose prior came from another consensus refinement, outside every candidate's window."""
    data = particles(n, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    grid = make_pose_marginal().grid
    prior = grid[torch.arange(n) % len(grid)] + 0.02 * torch.randn(n, 4, generator=g)
    if off_grid is not None:
        far = torch.randn(4, generator=g)
        prior[off_grid] = far - (grid.T @ torch.linalg.lstsq(grid.T, far[:, None]).solution)[:, 0]
    prior = F.normalize(prior, dim=-1)
    img, _, log_df, _ = data.tensors
    return torch.utils.data.TensorDataset(img, prior, log_df)
