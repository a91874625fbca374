"""Neural decoding models, as computational neuroscientists write them, for
``test_neural_decoding``.

- ``LFADS``: a sequential VAE of binned spike counts ``(B, T, N_s)`` from sessions with different
  neuron counts, stitched by per-session read-in and read-out layers; a bidirectional GRU
  encoder (padded time bins masked), an initial condition ``g0`` with a KL to a learned prior,
  a controller GRU cell inferring inputs to the generator GRU cell, factors, and log rates.
  ``LFADSLoss``: the Poisson NLL of the counts at their log rates over the real bins (only the
  entries coordinated dropout hid from the encoder, when it is on), the KL, and an optional
  smoothness penalty on the factors' step lengths.
- ``CalciumEncoder``: raw fluorescence ``(B, T, R)`` of calcium imaging normalised to dF/F with
  a rolling percentile baseline F0 (or z-scored per ROI), a temporal conv encoder and an
  embedding per time bin, trained CEBRA-style: ``InfoNCE`` over time-offset positives, other
  trials' positives as negatives.
- ``PoissonGLM``: a stimulus filter and a spike-history filter under ``exp`` (the canonical
  link), trained on the Poisson NLL.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

T, SESSIONS = 16, (12, 9)  # time bins a trial; neurons per session
ROIS, WINDOW = 8, 7  # calcium: ROIs, rolling baseline window (bins)
LAGS, STIM = 5, 3  # GLM: spike-history lags, stimulus features


class LFADS(nn.Module):
    def __init__(self, neurons=SESSIONS, read: int = 8, enc: int = 12, gen: int = 16,
                 con: int = 8, latent: int = 6, inputs: int = 2, factors: int = 4,
                 rate_norm: bool = False):
        super().__init__()
        self.rate_norm = rate_norm
        self.read_in = nn.ModuleList(nn.Linear(n, read) for n in neurons)
        self.encoder = nn.GRU(read, enc, batch_first=True, bidirectional=True)
        self.posterior = nn.Linear(2 * enc, 2 * latent)
        self.prior_mean = nn.Parameter(torch.zeros(latent))
        self.prior_logvar = nn.Parameter(torch.zeros(latent))
        self.g0_to_gen = nn.Linear(latent, gen)
        self.controller = nn.GRUCell(2 * enc + factors, con)
        self.co = nn.Linear(con, 2 * inputs)
        self.generator = nn.GRUCell(inputs, gen)
        self.factors = nn.Linear(gen, factors)
        self.read_out = nn.ModuleList(nn.Linear(factors, n) for n in neurons)
        self.con = con

    def forward(self, counts, mask, session: int):
        """``counts`` ``(B, T, N_session)``, ``mask`` ``(B, T)`` 1 at a trial's real bins."""
        if self.rate_norm:  # each neuron's counts over its mean rate in the batch
            counts = counts / (counts * mask[..., None]).sum((0, 1)) * mask.sum()
        x = self.read_in[session](torch.log1p(counts)) * mask[..., None]
        h, _ = self.encoder(x)
        pooled = (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        mean, logvar = self.posterior(pooled).chunk(2, -1)
        g0 = mean + torch.exp(0.5 * logvar) * torch.randn_like(mean)
        kl = 0.5 * (self.prior_logvar - logvar
                    + (logvar.exp() + (mean - self.prior_mean) ** 2) / self.prior_logvar.exp()
                    - 1).sum(-1)
        g = torch.tanh(self.g0_to_gen(g0))
        c = h.new_zeros(len(h), self.con)
        f = self.factors(g)
        out = []
        for t in range(h.shape[1]):
            c = self.controller(torch.cat([h[:, t], f], -1), c)
            u_mean, u_logvar = self.co(c).chunk(2, -1)
            u = u_mean + torch.exp(0.5 * u_logvar) * torch.randn_like(u_mean)
            g = self.generator(u, g)
            f = self.factors(g)
            out.append(f)
        factors = torch.stack(out, 1)  # (B, T, factors)
        return self.read_out[session](factors), kl, factors


def make_lfads() -> LFADS:
    torch.manual_seed(0)
    return LFADS()


def make_lfads_rate_norm() -> LFADS:
    torch.manual_seed(0)
    return LFADS(rate_norm=True)


def make_lfads_drifted_prior() -> LFADS:
    """A checkpoint whose learned prior's log-variance the KL kept lowering (an unbounded
    prior variance parameter): -110, below float32's exp range."""
    model = make_lfads()
    with torch.no_grad():
        model.prior_logvar.fill_(-110.0)
    return model


class LFADSLoss(nn.Module):
    """Poisson NLL at log rates over the real bins (or only the entries coordinated dropout
    hid) + ``kl_weight`` KL + ``smooth`` times the factors' step lengths over real bins."""

    def __init__(self, kl_weight: float = 0.1, smooth: float = 0.0, smooth_eps: float = 1e-8):
        super().__init__()
        self.kl_weight, self.smooth, self.smooth_eps = kl_weight, smooth, smooth_eps

    def forward(self, out, counts, mask, held_out=None):
        log_rates, kl, factors = out
        nll = F.poisson_nll_loss(log_rates, counts, log_input=True, full=False,
                                 reduction="none")
        w = mask[..., None].expand_as(nll)
        if held_out is not None:  # coordinated dropout: score only what the encoder missed
            w = w * held_out
        loss = (nll * w).sum() / w.sum() + self.kl_weight * kl.mean()
        if self.smooth:
            step = (factors[:, 1:] - factors[:, :-1]) * mask[:, 1:, None]
            length = (step.pow(2).sum(-1) + self.smooth_eps).sqrt()
            loss = loss + self.smooth * length.sum(1).mean()
        return loss


def spike_batch(g: torch.Generator, session: int, n: int = 6, short: tuple = (),
                silent: tuple = (), aborted: tuple = ()):
    """Poisson counts of trials of session ``session`` from smooth latent rates, padded to T:
    the trials in ``short`` end at T // 2 (their later bins 0, mask 0); the neurons in
    ``silent`` never fire in this session (a unit lost after spike sorting); the trials in
    ``aborted`` have no bin left after alignment to the go cue (mask all 0)."""
    neurons = SESSIONS[session]
    t = torch.linspace(0, 1, T)
    phase = torch.rand(n, 1, 1, generator=g) * 6.28
    tuning = torch.randn(1, 1, neurons, generator=g)
    rate = torch.exp(0.5 + 0.8 * torch.sin(6.28 * t[None, :, None] + phase + tuning))
    counts = torch.poisson(rate, generator=g)
    mask = torch.ones(n, T)
    for i in short:
        mask[i, T // 2:] = 0
    for i in aborted:
        mask[i] = 0
    counts = counts * mask[..., None]
    for j in silent:
        counts[..., j] = 0
    return counts, mask


def coordinated_dropout(g: torch.Generator, counts, p: float = 0.3):
    """The entries hidden from the encoder (1) and the input with them zeroed, rescaled."""
    held_out = (torch.rand(counts.shape, generator=g) < p).float()
    return counts * (1 - held_out) / (1 - p), held_out


# ---------------------------------------------------------------- calcium imaging / CEBRA


def rolling_percentile(f, window: int = WINDOW, q: float = 0.2):
    """F0: the ``q`` quantile of each ROI's fluorescence over a centred window of bins."""
    pad = window // 2
    padded = torch.cat([f[:, :1].expand(-1, pad, -1), f, f[:, -1:].expand(-1, pad, -1)], 1)
    return torch.quantile(padded.unfold(1, window, 1), q, dim=-1)


class CalciumEncoder(nn.Module):
    """Raw fluorescence ``(B, T, R)`` to an embedding per bin ``(B, T, dim)``: dF/F with a
    rolling percentile baseline (``norm="dff"``) or each ROI z-scored over the trial
    (``norm="zscore"``, its variance written in one pass as E[F^2] - E[F]^2)."""

    def __init__(self, rois: int = ROIS, hidden: int = 16, dim: int = 4, norm: str = "dff"):
        super().__init__()
        self.norm = norm
        self.conv1 = nn.Conv1d(rois, hidden, 3, padding=1)
        self.conv2 = nn.Conv1d(hidden, hidden, 3, padding=1)
        self.embed = nn.Conv1d(hidden, dim, 1)

    def forward(self, f):
        if self.norm == "dff":
            f0 = rolling_percentile(f)
            x = (f - f0) / f0
        else:
            mean = f.mean(1, keepdim=True)
            var = (f * f).mean(1, keepdim=True) - mean * mean
            x = (f - mean) / var.sqrt()
        h = F.gelu(self.conv1(x.transpose(1, 2)))
        h = F.gelu(self.conv2(h)) + h
        return self.embed(h).transpose(1, 2)


def make_calcium() -> CalciumEncoder:
    torch.manual_seed(0)
    return CalciumEncoder()


def make_calcium_zscore() -> CalciumEncoder:
    torch.manual_seed(0)
    return CalciumEncoder(norm="zscore")


class InfoNCE(nn.Module):
    """CEBRA's InfoNCE: the embedding at bin t of each trial against its own embedding at
    ``t + offset`` (the positive) and the other trials' (negatives), cosine similarity over a
    temperature. ``stable=False`` writes the softmax out as exp over a sum of exps."""

    def __init__(self, temperature: float = 1.0, offset: int = 2, stable: bool = True):
        super().__init__()
        self.temperature, self.offset, self.stable = temperature, offset, stable

    def forward(self, emb, t):
        ref = F.normalize(emb[:, t], dim=-1)
        pos = F.normalize(emb[:, t + self.offset], dim=-1)
        sim = ref @ pos.T / self.temperature  # (B, B): the diagonal holds the positives
        if self.stable:
            return F.cross_entropy(sim, torch.arange(len(sim)))
        e = torch.exp(sim)
        return -torch.log(e.diagonal() / e.sum(1)).mean()


def calcium_batch(g: torch.Generator, n: int = 6, dead: tuple = (), offset: dict | None = None):
    """Raw fluorescence of ``n`` trials: a baseline of ~100 per ROI, calcium transients
    (spikes under an AR(1) decay), shot noise. ``dead``: (trial, roi) pairs whose ROI reads 0
    all trial (a cell that drifted out of the field of view, masked by motion correction);
    ``offset``: trial -> a camera offset added to every ROI (a rig whose 16-bit baseline is
    not subtracted)."""
    spikes = (torch.rand(n, T, ROIS, generator=g) < 0.1).float()
    c = torch.zeros(n, ROIS)
    trace = []
    for t in range(T):  # AR(1) calcium: c_t = gamma c_{t-1} + s_t
        c = 0.8 * c + spikes[:, t]
        trace.append(c)
    base = 100 + 20 * torch.rand(n, 1, ROIS, generator=g)
    f = base * (1 + 0.5 * torch.stack(trace, 1)) + torch.randn(n, T, ROIS, generator=g)
    for i, r in dead:
        f[i, :, r] = 0
    for i, v in (offset or {}).items():
        f[i] = f[i] * 1e-3 + v  # a dim cell on a large offset: small swings on a big number
    return f


# ---------------------------------------------------------------- Poisson GLM


class PoissonGLM(nn.Module):
    """Log rate = stimulus filter + spike-history filter + bias; the rate is its ``exp``."""

    def __init__(self, stim: int = STIM, lags: int = LAGS):
        super().__init__()
        self.stim = nn.Linear(stim, 1)
        self.history = nn.Linear(lags, 1, bias=False)

    def forward(self, stim, history):
        return torch.exp(self.stim(stim) + self.history(history)).squeeze(-1)


def make_glm() -> PoissonGLM:
    torch.manual_seed(0)
    return PoissonGLM()


def glm_nll(rate, counts):
    """The Poisson NLL at rates (constant log y! dropped), with an eps under the log."""
    return (rate - counts * torch.log(rate + 1e-8)).mean()


def glm_batch(g: torch.Generator, n: int = 32, wrapped: tuple = ()):
    """Stimulus, spike-history design matrix (the previous LAGS bins' counts) and counts of
    ``n`` bins. ``wrapped``: bins whose history holds a missing count of -1 read back from a
    uint16 array, 65535."""
    stim = torch.randn(n, STIM, generator=g)
    past = torch.poisson(torch.full((n, LAGS), 1.5), generator=g)
    counts = torch.poisson(torch.exp(0.3 * stim[:, 0] + 0.1 * past.mean(1)), generator=g)
    for i in wrapped:
        past[i, 3] = 65535.0
    return stim, past, counts
