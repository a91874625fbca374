"""Astronomy models as survey ML code writes them, for ``test_astronomy``.

- ``PhotoZ``: photometric redshift from ``ugriz`` fluxes (nanomaggies, sky-subtracted): the
  model turns them into AB magnitudes ``m = 22.5 - 2.5 log10(flux)`` and colours inside
  ``forward``, an MLP predicts the redshift and its log-variance (heteroscedastic).
  ``from_mags``: the catalogue gives magnitudes instead, missing bands coded 99/-99; the model
  converts them back to fluxes ``10 ** (-0.4 (m - 22.5))`` for an inverse-variance weighting.
  ``floor``: a learned systematic error floor ``sys_var`` added to the predicted variance.
- ``gaussian_nll``: the heteroscedastic Gaussian NLL on the predicted log-variance.
- ``MDNPhotoZ`` / ``mdn_nll``: a mixture density network for redshift PDFs, its NLL written as
  the log of the mixture's density (``naive``) or with ``logsumexp``.
- ``LightCurveTransformer``: irregularly sampled multi-band light curves as tokens
  ``(time, band, flux, flux_err)`` with a padding mask, a transformer encoder, a masked mean
  pool and a class head; ``standardise``: each object's fluxes standardised in ``forward`` with
  the one-pass variance; ``JitterLoss``: given the model, an inverse-variance weighted
  reconstruction term with the model's learned jitter added to the flux errors, padded tokens
  left out with ``torch.where``.
- ``MorphologyCNN``: galaxy cutouts ``(B, 3, 32, 32)``, rotation augmentation, a small CNN.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

BANDS = 5
ZP = 22.5  # AB zero point of nanomaggies


class PhotoZ(nn.Module):
    def __init__(self, hidden: int = 32, from_mags: bool = False, floor: bool = False):
        super().__init__()
        self.from_mags = from_mags
        # a learned systematic error floor (zero-point errors), added to the predicted variance
        self.sys_var = nn.Parameter(torch.tensor(0.02)) if floor else None
        self.net = nn.Sequential(nn.Linear(2 * BANDS - 1, hidden), nn.ReLU(),
                                 nn.Linear(hidden, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, 2)  # redshift, log-variance

    def forward(self, x):
        if self.from_mags:  # catalogue magnitudes back to fluxes, then standardised
            flux = 10 ** (-0.4 * (x - ZP))
            mags = ZP - 2.5 * torch.log10(flux / flux.sum(1, keepdim=True)) - 25.0
        else:
            mags = ZP - 2.5 * torch.log10(x)  # AB magnitudes of the sky-subtracted fluxes
        colours = mags[:, :-1] - mags[:, 1:]
        feats = torch.cat([(mags - 20.0) / 2.0, colours], dim=1)
        out = self.head(self.net(feats))
        if self.sys_var is not None:  # var = exp(log_var) + sys_var, in log space
            return out[:, 0], torch.logaddexp(out[:, 1], torch.log(self.sys_var))
        return out[:, 0], out[:, 1]


def make_photoz() -> PhotoZ:
    torch.manual_seed(0)
    return PhotoZ()


def make_photoz_floor() -> PhotoZ:
    torch.manual_seed(0)
    return PhotoZ(floor=True)


def make_photoz_mags() -> PhotoZ:
    torch.manual_seed(0)
    return PhotoZ(from_mags=True)


def gaussian_nll(pred, z):
    """Heteroscedastic Gaussian NLL: 0.5 (log var + (z - mu)^2 / var) on the log-variance."""
    mu, log_var = pred
    return 0.5 * (log_var + (z - mu) ** 2 * torch.exp(-log_var)).mean()


class MDNPhotoZ(nn.Module):
    def __init__(self, hidden: int = 32, k: int = 3, log_sigma0: float = -1.0):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(BANDS, hidden), nn.Tanh())
        self.logits = nn.Linear(hidden, k)
        self.mu = nn.Linear(hidden, k)
        self.log_sigma = nn.Linear(hidden, k)
        nn.init.constant_(self.log_sigma.bias, log_sigma0)  # photo-z scatter ~0.4 at the start

    def forward(self, mags):
        h = self.net((mags - 20.0) / 2.0)
        return self.logits(h), F.softplus(self.mu(h)), self.log_sigma(h)


def make_mdn() -> MDNPhotoZ:
    torch.manual_seed(0)
    return MDNPhotoZ()


class MDNLoss(nn.Module):
    def __init__(self, naive: bool = True):
        super().__init__()
        self.naive = naive

    def forward(self, out, z):
        logits, mu, log_sigma = out
        z = z[:, None]
        if self.naive:  # the mixture's density, then its log
            pi = torch.softmax(logits, -1)
            sigma = torch.exp(log_sigma)
            dens = pi * torch.exp(-0.5 * ((z - mu) / sigma) ** 2) / (sigma * math.sqrt(2 * math.pi))
            return -torch.log(dens.sum(-1)).mean()
        log_comp = (-0.5 * ((z - mu) / log_sigma.exp()) ** 2 - log_sigma
                    - 0.5 * math.log(2 * math.pi))
        return -torch.logsumexp(torch.log_softmax(logits, -1) + log_comp, -1).mean()


class LightCurveTransformer(nn.Module):
    def __init__(self, d: int = 16, classes: int = 4, jitter: bool = False,
                 standardise: bool = False):
        super().__init__()
        self.standardise = standardise
        self.inp = nn.Linear(3, d)  # time (scaled), flux, flux_err
        self.band = nn.Embedding(BANDS, d)
        layer = nn.TransformerEncoderLayer(d, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(d, classes)
        self.recon = nn.Linear(d, 1)
        self.jitter = nn.Parameter(torch.zeros(())) if jitter else None

    def forward(self, t, band, flux, flux_err, pad):
        if self.standardise:  # each object's fluxes to zero mean, unit std (one pass)
            keep = (~pad).to(flux.dtype)
            n = keep.sum(1, keepdim=True)
            mean = (flux * keep).sum(1, keepdim=True) / n
            var = (flux ** 2 * keep).sum(1, keepdim=True) / n - mean ** 2
            flux, flux_err = (flux - mean) / var.sqrt(), flux_err / var.sqrt()
        x = torch.stack([t / 100.0, flux, flux_err], -1)
        h = self.encoder(self.inp(x) + self.band(band), src_key_padding_mask=pad)
        keep = (~pad).unsqueeze(-1).to(h.dtype)
        pooled = (h * keep).sum(1) / keep.sum(1)
        return self.head(pooled), self.recon(h).squeeze(-1)


def make_lightcurve() -> LightCurveTransformer:
    torch.manual_seed(0)
    return LightCurveTransformer()


def make_lightcurve_standardised() -> LightCurveTransformer:
    torch.manual_seed(0)
    return LightCurveTransformer(standardise=True)


def make_lightcurve_jitter() -> LightCurveTransformer:
    torch.manual_seed(0)
    return LightCurveTransformer(jitter=True)


class JitterLoss(nn.Module):
    """Cross-entropy of the class plus a chi^2 of the reconstructed fluxes with inverse-variance
    weights ``1 / (flux_err^2 + jitter^2)``; padded tokens are left out with ``torch.where``."""

    def __init__(self, model: LightCurveTransformer):
        super().__init__()
        self.model = model

    def forward(self, out, y, flux, flux_err, pad):
        logits, recon = out
        var = flux_err ** 2 + self.model.jitter ** 2
        ivar = torch.where(pad, torch.zeros_like(var), 1.0 / var)
        chi2 = (ivar * (recon - flux) ** 2).sum(1) / (~pad).sum(1)
        return F.cross_entropy(logits, y) + 0.01 * chi2.mean()


class MorphologyCNN(nn.Module):
    def __init__(self, classes: int = 3):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(16, classes)

    def forward(self, img):
        return self.head(self.features(img))


def make_morphology() -> MorphologyCNN:
    torch.manual_seed(0)
    return MorphologyCNN()


# ----------------------------------------------------------------------------- data

def photometry(g: torch.Generator, n: int, negative: int | None = None):
    """Fluxes of galaxies at redshift z: a red-shifted spectral slope, noise; ``negative``:
    that row's u-band flux is negative after sky subtraction (a faint source)."""
    z = torch.rand(n, generator=g) * 2.0
    slope = torch.linspace(-1, 1, BANDS)
    mag = 21.0 + z[:, None] * slope + 0.3 * torch.randn(n, BANDS, generator=g)
    flux = 10 ** (-0.4 * (mag - ZP))
    flux_err = 0.05 * flux + 0.01
    if negative is not None:
        flux[negative, 0] = -0.2
    return flux, flux_err, z


def catalogue_mags(g: torch.Generator, n: int, missing: int | None = None, code=-99.0):
    """Magnitudes; ``missing``: that row's z-band is not observed, coded ``code``."""
    flux, _, z = photometry(g, n)
    mags = ZP - 2.5 * torch.log10(flux)
    if missing is not None:
        mags[missing, -1] = code
    return mags, z


def light_curves(g: torch.Generator, n: int, length: int = 12, empty: int | None = None,
                 bright: int | None = None):
    """Irregular multi-band light curves, each with a random number of observations, padded;
    ``empty``: that object has no detection at all (every token padded); ``bright``: that
    object is a bright non-variable star, its fluxes ~3e4 with a scatter of 0.1."""
    items = []
    for i in range(n):
        k = 0 if i == empty else int(torch.randint(4, length + 1, (1,), generator=g))
        t = torch.sort(torch.rand(k, generator=g) * 100).values
        band = torch.randint(0, BANDS, (k,), generator=g)
        y = int(torch.randint(0, 4, (1,), generator=g))
        flux = torch.sin(t / (5 + 5 * y)) + 0.1 * torch.randn(k, generator=g)
        if i == bright:
            flux = 3e4 + 0.1 * torch.randn(k, generator=g)
        err = 0.1 + 0.05 * torch.rand(k, generator=g)
        items.append((t, band, flux, err, y))
    return items


def collate_light_curves(items, length: int = 12, err_pad: float = 1.0):
    n = len(items)
    t = torch.zeros(n, length)
    band = torch.zeros(n, length, dtype=torch.long)
    flux = torch.zeros(n, length)
    err = torch.full((n, length), err_pad)
    pad = torch.ones(n, length, dtype=torch.bool)
    for i, (ti, bi, fi, ei, _) in enumerate(items):
        k = len(ti)
        t[i, :k], band[i, :k], flux[i, :k], err[i, :k], pad[i, :k] = ti, bi, fi, ei, False
    y = torch.tensor([it[4] for it in items])
    return t, band, flux, err, pad, y


def cutouts(g: torch.Generator, n: int, counts: bool = False):
    """Galaxy cutouts: an elliptical Sersic-like blob per class; ``counts``: raw CCD counts
    (~1e4) instead of calibrated, normalised images."""
    yy, xx = torch.meshgrid(torch.linspace(-1, 1, 32), torch.linspace(-1, 1, 32), indexing="ij")
    y = torch.randint(0, 3, (n,), generator=g)
    q = 0.3 + 0.3 * y.float()  # axis ratio per class
    r = torch.sqrt(xx ** 2 + (yy[None] / q[:, None, None]) ** 2)
    img = torch.exp(-4 * r)[:, None].repeat(1, 3, 1, 1)
    img = img + 0.05 * torch.randn(img.shape, generator=g)
    return (img * 2e4 + 1e3 if counts else img), y
