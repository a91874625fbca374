"""Tensor-network models as research code writes them in torch (Stoudenmire & Schwab's MPS
classifier, torchmps, Han et al.'s Born machine, Novikov et al.'s TT layers), for
``test_tensor_networks``.

- ``MPSClassifier``: 8x8 images as a chain of 64 sites, each pixel's local feature map
  (``[cos, sin]`` or the polynomial ``[1, x]`` of exponential machines) contracted site by site
  into the boundary vector with ``torch.einsum``; cores initialised to the identity plus noise
  (torchmps), the label tensor on the last bond. ``normalise=True``: the boundary vector is
  divided by its norm at each site and the log norms accumulated (log-scale tracking).
- ``MPSSequence``: the same chain over variable-length sequences with a padding mask;
  ``skip_pads`` makes a pad's transfer matrix the identity (the fix), otherwise the pad's
  feature vector is multiplied by 0 (the bug: the boundary vector of a padded record is 0).
- ``BornMachine``: a generative MPS over binarised images; ``log |psi(x)|^2`` tracked in log
  scale, ``log Z`` contracted through the transfer matrices ``sum_s A_s (x) A_s``, either
  rescaled at each site (``scaled_z``) or not (the bug: Z underflows over 64 sites).
- ``TTSVDLinear``: a Linear whose weight is projected onto rank ``r`` by a truncated SVD in each
  forward (TT-SVD of the weight), the rank-r factors fed on; an ``eye_`` initialisation ties
  every singular value.
- ``EntangledMPS``: the normalised classifier plus the entanglement entropy of its middle bond
  as a regulariser; grown from bond 6 to 10 by zero padding, some singular values are 0.
- ``LogMPS``: a non-negative MPS (a left-to-right HMM) contracted by logsumexp, its band and
  start state -inf masks (``fill=-1e9``: the finite fill).
- ``IsometricMPS``: left-isometric cores, the Q of a QR of each core's parameter.
- ``TTLinear``: a TT-matrix Linear (two cores, one einsum), run under bf16 autocast.
- ``SymmetricBorn``: a particle-number-conserving Born machine (a U(1) block mask on the cores).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# ---------------------------------------------------------------------------------------------
# MPS classifier


def trig_features(x):
    """Stoudenmire & Schwab's local feature map of pixels in [0, 1]: (B, N) -> (B, N, 2)."""
    return torch.stack([torch.cos(math.pi / 2 * x), torch.sin(math.pi / 2 * x)], -1)


def poly_features(x):
    """Exponential machines' polynomial feature map ``[1, x]``: (B, N) -> (B, N, 2)."""
    return torch.stack([torch.ones_like(x), x], -1)


def identity_cores(n_sites: int, bond: int, d: int, std: float) -> torch.Tensor:
    """torchmps's initialisation: each core the identity on its bond plus small noise."""
    eye = torch.eye(bond)[:, None, :].expand(bond, d, bond) / d
    return eye.repeat(n_sites, 1, 1, 1) + std * torch.randn(n_sites, bond, d, bond)


class MPSClassifier(nn.Module):
    def __init__(self, n_sites: int = 64, bond: int = 10, n_classes: int = 4,
                 features: str = "trig", normalise: bool = True):
        super().__init__()
        self.cores = nn.Parameter(identity_cores(n_sites, bond, 2, 1e-2))
        self.left = nn.Parameter(torch.ones(bond) / math.sqrt(bond))
        self.label = nn.Parameter(0.1 * torch.randn(bond, n_classes))
        self.features, self.normalise = features, normalise

    def forward(self, x):
        phi = trig_features(x) if self.features == "trig" else poly_features(x)
        v = self.left.expand(x.shape[0], -1)
        log_norm = torch.zeros(x.shape[0])
        for i in range(self.cores.shape[0]):
            m = torch.einsum("bs,lsr->blr", phi[:, i], self.cores[i])
            v = torch.einsum("bl,blr->br", v, m)
            if self.normalise:  # rescale and keep the scale in log space
                norm = v.norm(dim=1, keepdim=True)
                v = v / norm
                log_norm = log_norm + norm.squeeze(1).log()
        return v @ self.label  # the bug (unnormalised): 64 sites of [1, x] past 1e38


def make_mps() -> MPSClassifier:
    torch.manual_seed(0)
    return MPSClassifier()


def make_mps_poly_raw() -> MPSClassifier:
    torch.manual_seed(0)
    return MPSClassifier(features="poly", normalise=False)


def make_mps_poly() -> MPSClassifier:
    torch.manual_seed(0)
    return MPSClassifier(features="poly", normalise=True)


def digits_batch(g: torch.Generator, bad: int | None = None, n: int = 16):
    """8x8 'digits' in [0, 1] (a class's blob plus noise), labels in 0..3; ``bad``: one image
    left in uint8 scale, 0..255 (the loader's ``/ 255`` skipped for one source)."""
    y = torch.randint(0, 4, (n,), generator=g)
    grid = torch.arange(64).float()
    centre = (y.float() * 16 + 8)[:, None]
    x = torch.exp(-((grid - centre) / 6) ** 2) + 0.1 * torch.rand(n, 64, generator=g)
    x = x.clamp(0, 1)
    if bad is not None:
        x[bad] = torch.round(x[bad] * 255)
    return x, y


# ---------------------------------------------------------------------------------------------
# MPS over padded sequences


class MPSSequence(nn.Module):
    def __init__(self, max_len: int = 24, bond: int = 8, n_classes: int = 3,
                 skip_pads: bool = False):
        super().__init__()
        self.cores = nn.Parameter(identity_cores(max_len, bond, 2, 1e-2))
        self.left = nn.Parameter(torch.ones(bond) / math.sqrt(bond))
        self.label = nn.Parameter(0.1 * torch.randn(bond, n_classes))
        self.register_buffer("eye", torch.eye(bond))
        self.skip_pads = skip_pads

    def forward(self, x, mask):
        """x: (B, T) in [0, 1]; mask: (B, T) bool, False at pads. Returns (logits, log norm)."""
        phi = trig_features(x)
        if not self.skip_pads:
            phi = phi * mask[..., None]  # the bug: a pad's transfer matrix is 0, not the identity
        v = self.left.expand(x.shape[0], -1)
        log_norm = torch.zeros(x.shape[0])
        for i in range(x.shape[1]):
            m = torch.einsum("bs,lsr->blr", phi[:, i], self.cores[i])
            if self.skip_pads:
                m = torch.where(mask[:, i, None, None], m, self.eye)
            v = torch.einsum("bl,blr->br", v, m)
            norm = v.norm(dim=1, keepdim=True)
            v = v / norm  # 0/0 once a padded record's boundary vector is 0
            log_norm = log_norm + norm.squeeze(1).log()
        return v @ self.label, log_norm


def make_sequence() -> MPSSequence:
    torch.manual_seed(0)
    return MPSSequence()


def make_sequence_skip() -> MPSSequence:
    torch.manual_seed(0)
    return MPSSequence(skip_pads=True)


def sequence_batch(g: torch.Generator, short: int | None = None, n: int = 12, t: int = 24):
    """Sensor sequences in [0, 1] and their labels; every record full length but ``short``,
    which ends after 15 steps (padded with zeros, mask False)."""
    y = torch.randint(0, 3, (n,), generator=g)
    x = torch.rand(n, t, generator=g) * 0.5 + 0.25 * y[:, None].float()
    mask = torch.ones(n, t, dtype=torch.bool)
    if short is not None:
        mask[short, 15:] = False
        x[short, 15:] = 0.0
    return x, mask, y


def sequence_loss(logits, log_norm, y):
    """Cross-entropy plus a small penalty keeping the log norm near 0 (the chain's scale)."""
    return F.cross_entropy(logits, y) + 1e-3 * log_norm.pow(2).mean()


# ---------------------------------------------------------------------------------------------
# Born machine


class BornMachine(nn.Module):
    def __init__(self, n_sites: int = 64, bond: int = 8, std: float = 0.05,
                 scaled_z: bool = False):
        super().__init__()
        self.cores = nn.Parameter(std * torch.randn(n_sites, bond, 2, bond))
        self.register_buffer("left", torch.ones(bond) / math.sqrt(bond))
        self.register_buffer("right", torch.ones(bond) / math.sqrt(bond))
        self.scaled_z = scaled_z

    def log_psi2(self, x):
        """log |psi(x)|^2 of binary strings x (B, N), the boundary vector rescaled per site."""
        v = self.left.expand(x.shape[0], -1)
        log_norm = torch.zeros(x.shape[0])
        for i in range(self.cores.shape[0]):
            a = self.cores[i][:, x[:, i], :]  # (D, B, D): each sample's matrix at site i
            v = torch.einsum("bl,lbr->br", v, a)
            norm = v.norm(dim=1, keepdim=True)
            v, log_norm = v / norm, log_norm + norm.squeeze(1).log()
        psi = v @ self.right
        return 2 * (log_norm + psi.abs().log())

    def log_z(self):
        """log sum_x |psi(x)|^2, contracted through the transfer matrices sum_s A_s (x) A_s."""
        env = torch.outer(self.left, self.left).flatten()
        log_scale = torch.zeros(())
        for a in self.cores:
            e = torch.einsum("lsr,msn->lmrn", a, a).reshape(env.shape[0], env.shape[0])
            env = env @ e
            if self.scaled_z:
                s = env.norm()
                env, log_scale = env / s, log_scale + s.log()
        z = env @ torch.outer(self.right, self.right).flatten()
        return log_scale + torch.log(z)  # the bug (unscaled): z underflows to 0 over 64 sites

    def forward(self, x):
        return self.log_psi2(x) - self.log_z()  # each string's log-likelihood


def make_born() -> BornMachine:
    torch.manual_seed(0)
    return BornMachine()


def make_born_scaled() -> BornMachine:
    torch.manual_seed(0)
    return BornMachine(scaled_z=True)


def nll(log_likelihood):
    return -log_likelihood.mean()


def binary_batch(g: torch.Generator, n: int = 16):
    """Binarised 8x8 'digits' as long tensors (B, 64)."""
    x, _ = digits_batch(g, n=n)
    return (x > 0.5).long()


# ---------------------------------------------------------------------------------------------
# TT-SVD-projected Linear


class TTSVDLinear(nn.Module):
    """A Linear projected onto rank r each forward: W = U_r diag(S_r) V_r^T from a truncated
    SVD, applied as the two factors (x V_r) diag(S_r) U_r^T."""

    def __init__(self, dim: int, rank: int, init: str = "orthogonal"):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dim))
        if init == "eye":
            nn.init.eye_(self.weight)  # every singular value 1: tied at the SVD gradient's pole
        else:
            nn.init.orthogonal_(self.weight)
            with torch.no_grad():
                self.weight.mul_(torch.linspace(2.0, 0.5, dim)[:, None])
        self.bias = nn.Parameter(torch.zeros(dim))
        self.rank = rank

    def forward(self, x):
        u, s, vh = torch.linalg.svd(self.weight, full_matrices=False)
        u, s, vh = u[:, :self.rank], s[:self.rank], vh[:self.rank]
        return (x @ vh.T) * s @ u.T + self.bias


class TTRegressor(nn.Module):
    def __init__(self, dim: int = 16, rank: int = 4, init: str = "orthogonal"):
        super().__init__()
        self.inp = nn.Linear(8, dim)
        self.tt = TTSVDLinear(dim, rank, init)
        self.out = nn.Linear(dim, 1)

    def forward(self, x):
        return self.out(torch.tanh(self.tt(torch.tanh(self.inp(x)))))


def make_tt() -> TTRegressor:
    torch.manual_seed(0)
    return TTRegressor()


def make_tt_eye() -> TTRegressor:
    torch.manual_seed(0)
    return TTRegressor(init="eye")


def regression_batch(g: torch.Generator, n: int = 16):
    x = torch.randn(n, 8, generator=g)
    return x, x[:, :1] * x[:, 1:2]


# ---------------------------------------------------------------------------------------------
# MPS with an entanglement-entropy regulariser, its bond grown by zero padding


class EntangledMPS(MPSClassifier):
    """The normalised MPS classifier, also returning the entanglement entropy of its middle
    bond (the singular values of the middle core's matricisation), which the loss penalises."""

    limit_form = condition = False

    def forward(self, x):
        n, bond = self.cores.shape[0], self.cores.shape[1]
        s = torch.linalg.svdvals(self.cores[n // 2].reshape(bond * 2, bond))
        if self.condition:  # a penalty on the bond's condition number, largest over smallest
            return super().forward(x), (s[0] / s[-1]).log()  # the bug: s[-1] of a padded bond
        p = s.pow(2) / s.pow(2).sum()
        if self.limit_form:  # 0 at p = 0, with a finite gradient there
            entropy = -torch.special.xlogy(p, p.clamp_min(torch.finfo(p.dtype).tiny)).sum()
        else:
            entropy = -(p * p.log()).sum()  # the bug: a padded bond's singular value is 0
        return super().forward(x), entropy


def grow_bond(model: MPSClassifier, bond: int) -> None:
    """Widen the bond dimension by zero padding (the new directions start empty), as a bond
    dimension schedule does between stages."""
    n, old, d, _ = model.cores.shape
    cores = torch.zeros(n, bond, d, bond)
    cores[:, :old, :, :old] = model.cores.data
    left, label = torch.zeros(bond), torch.zeros(bond, model.label.shape[1])
    left[:old], label[:old] = model.left.data, model.label.data
    model.cores, model.left, model.label = (nn.Parameter(cores), nn.Parameter(left),
                                            nn.Parameter(label))


def make_entangled() -> EntangledMPS:
    torch.manual_seed(0)
    return EntangledMPS(bond=6)


def make_entangled_grown() -> EntangledMPS:
    """A bond-6 stage's MPS grown to bond 10."""
    model = make_entangled()
    grow_bond(model, 10)
    return model


def make_entangled_grown_xlogy() -> EntangledMPS:
    model = make_entangled_grown()
    model.limit_form = True
    return model


def make_conditioned_grown() -> EntangledMPS:
    model = make_entangled_grown()
    model.condition = True
    return model


def entangled_loss(logits, entropy, y):
    return F.cross_entropy(logits, y) + 1e-2 * entropy


# ---------------------------------------------------------------------------------------------
# non-negative MPS (an HMM) contracted in log space


class LogMPS(nn.Module):
    """Glasser et al.'s non-negative MPS, equivalently a left-to-right HMM over the bond
    states, contracted in log space: a log-likelihood by logsumexp site by site. The band
    (a state moves on by at most one) is a -inf mask on the transition logits; every string
    starts in state 0, so the states past t are unreachable at site t."""

    def __init__(self, bond: int = 8, n_symbols: int = 2, fill: float = float("-inf")):
        super().__init__()
        self.trans = nn.Parameter(0.1 * torch.randn(bond, bond))
        self.emit = nn.Parameter(0.1 * torch.randn(bond, n_symbols))
        self.register_buffer("band", torch.ones(bond, bond).triu().tril(1).bool())
        init = torch.full((bond,), fill)
        init[0] = 0.0
        self.register_buffer("log_init", init)
        self.fill = fill  # -inf: the bug; -1e9 (the fix): no slice of the scan all -inf

    def forward(self, x):
        log_t = torch.log_softmax(self.trans.masked_fill(~self.band, self.fill), 1)
        log_e = torch.log_softmax(self.emit, 1)
        alpha = self.log_init + log_e[:, x[:, 0]].T  # (B, D)
        for i in range(1, x.shape[1]):
            # all -inf for a state not yet reachable
            alpha = torch.logsumexp(alpha[:, :, None] + log_t, 1) + log_e[:, x[:, i]].T
        return torch.logsumexp(alpha, 1)


def make_log_mps() -> LogMPS:
    torch.manual_seed(0)
    return LogMPS()


def make_log_mps_finite_fill() -> LogMPS:
    torch.manual_seed(0)
    return LogMPS(fill=-1e9)


# ---------------------------------------------------------------------------------------------
# isometric MPS: each core an isometry by QR of a free parameter


class IsometricMPS(MPSClassifier):
    """The classifier with left-isometric cores (a unitary / quantum-circuit MPS): each core is
    the Q of a QR of its parameter's matricisation, so no boundary norm can grow or shrink."""

    def forward(self, x):
        n, bond = self.cores.shape[0], self.cores.shape[1]
        q, _ = torch.linalg.qr(self.cores.reshape(n, bond * 2, bond))
        phi, v = trig_features(x), self.left.expand(x.shape[0], -1)
        for i, core in enumerate(q.reshape(n, bond, 2, bond)):
            v = torch.einsum("bl,bs,lsr->br", v, phi[:, i], core)
        return v @ self.label


def make_isometric() -> IsometricMPS:
    torch.manual_seed(0)
    return IsometricMPS(bond=6)


def make_isometric_grown() -> IsometricMPS:
    model = make_isometric()
    grow_bond(model, 10)
    return model


# ---------------------------------------------------------------------------------------------
# tensor-train Linear (Novikov et al.'s TT-matrix)


class TTLinear(nn.Module):
    """A (16 x 16) weight as a TT-matrix of two cores, ``in = 4 x 4``, ``out = 4 x 4``, rank r,
    applied to the input by one einsum (no dense weight is ever formed)."""

    def __init__(self, rank: int = 3):
        super().__init__()
        self.g1 = nn.Parameter(torch.randn(4, 4, rank) / 2)
        self.g2 = nn.Parameter(torch.randn(rank, 4, 4) / math.sqrt(2 * rank))
        self.bias = nn.Parameter(torch.zeros(16))

    def forward(self, x):
        y = torch.einsum("bij,ikr,rjl->bkl", x.reshape(-1, 4, 4), self.g1, self.g2)
        return y.reshape(-1, 16) + self.bias


class TTNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.tt, self.out = nn.Linear(8, 16), TTLinear(), nn.Linear(16, 1)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):  # the TT contraction in bf16
            h = F.gelu(self.tt(F.gelu(self.inp(x))))
        return self.out(h.float())


def make_tt_bf16() -> TTNet:
    torch.manual_seed(0)
    return TTNet()


# ---------------------------------------------------------------------------------------------
# particle-number-conserving Born machine (a U(1)-symmetric MPS)


class SymmetricBorn(nn.Module):
    """A Born machine over strings of ``n_sites`` bits with exactly ``k`` ones: the bond index
    counts the ones so far (a U(1) block structure as a fixed mask on the cores), the right
    boundary picks count k, so a string with another count has amplitude exactly 0. log |psi|^2
    is tracked in log scale; Z sums |psi|^2 over the symmetric sector by transfer matrices."""

    def __init__(self, n_sites: int = 16, k: int = 4):
        super().__init__()
        bond = k + 2
        self.cores = nn.Parameter(1 + 0.1 * torch.randn(n_sites, bond, 2, bond))
        mask = torch.zeros(bond, 2, bond)
        for c in range(bond):
            mask[c, 0, c] = 1.0
            if c + 1 < bond:
                mask[c, 1, c + 1] = 1.0
        self.register_buffer("mask", mask)
        self.register_buffer("left", F.one_hot(torch.tensor(0), bond).float())
        self.register_buffer("right", F.one_hot(torch.tensor(k), bond).float())

    def forward(self, x):
        cores = self.cores * self.mask
        v, log_norm = self.left.expand(x.shape[0], -1), torch.zeros(x.shape[0])
        env, log_z = torch.outer(self.left, self.left), torch.zeros(())
        for i, a in enumerate(cores):
            v = torch.einsum("bl,lbr->br", v, a[:, x[:, i], :])
            norm = v.norm(dim=1, keepdim=True)
            v, log_norm = v / norm, log_norm + norm.squeeze(1).log()
            env = torch.einsum("lm,lsr,msn->rn", env, a, a)
            s = env.norm()
            env, log_z = env / s, log_z + s.log()
        log_z = log_z + (self.right @ env @ self.right).log()
        return 2 * (log_norm + (v @ self.right).abs().log()) - log_z  # -inf off the sector


def make_symmetric_born() -> SymmetricBorn:
    torch.manual_seed(0)
    return SymmetricBorn()


def sector_batch(g: torch.Generator, bad: int | None = None, n: int = 16, k: int = 4):
    """Occupation strings of 16 sites with exactly k particles; ``bad``: one with a bit
    flipped on (a corrupted record: k + 1 particles)."""
    order = torch.rand(n, 16, generator=g).argsort(1)
    x = torch.zeros(n, 16, dtype=torch.long).scatter_(1, order[:, :k], 1)
    if bad is not None:
        x[bad, order[bad, k]] = 1
    return x
