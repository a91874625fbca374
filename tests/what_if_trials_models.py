"""Models and loops of the what-if trials (``test_what_if_trials.py``): a user got a bundle and
asks ``nanreplay --try KEY=VALUE`` whether a change would have kept training finite. Each loop
takes the same change from a given step on (``Trial``), so a test can re-train from the
window's copy with it and hold the try's answer against what training does.

The factories are what the bundles name (``what_if_trials_models:make_...``), replayed from
this directory."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

D_IN, HIDDEN, BATCH = 8, 16, 16
POOL = 64  # steps of data drawn, whatever a run's length: a shorter run sees the same batches


@dataclass
class Trial:
    """One change from step ``start`` on (None: none), as ``--try`` makes it."""

    start: int | None = None
    lr_factor: float | None = None
    lr: float | None = None
    eps: float | None = None
    wd: float | None = None
    clip: float | None = None
    dtype: torch.dtype | None = None

    def on(self, step: int) -> bool:
        return self.start is not None and step >= self.start

    def apply(self, opt) -> None:
        """The optimizer settings of the change, set once as its first step begins."""
        for g in opt.param_groups:
            if self.lr is not None:
                g["lr"] = self.lr
            if self.lr_factor is not None:
                g["lr"] *= self.lr_factor
            if self.eps is not None:
                g["eps"] = self.eps
            if self.wd is not None:
                g["weight_decay"] = self.wd


def to_dtype(model: nn.Module, opt, dtype: torch.dtype) -> None:
    """Weights and optimizer state in ``dtype`` (``--try dtype=``), in place."""
    model.to(dtype)
    for st in opt.state.values():
        for k, v in st.items():
            if torch.is_tensor(v) and v.is_floating_point() and v.dim() > 0:
                st[k] = v.to(dtype)


# --- 1. Adam's eps under float16 weights -------------------------------------------------

class RateHead(nn.Module):
    """A small regressor trained in float16 end to end (``model.half()``), as memory-bound
    users do: weights and Adam's state in float16."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.Tanh())
        self.head = nn.Linear(HIDDEN, 1)

    def forward(self, x):
        return self.head(self.body(x))


def make_rate_head() -> nn.Module:
    torch.manual_seed(0)
    return RateHead()


def half_batches(n_steps: int, scale: float = 1e-3):
    """Targets ``scale`` times a feature: small ones make small gradients, whose squares
    float16 flushes to 0."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(POOL * BATCH, D_IN, generator=g)
    return _loader(x, scale * x[:, :1], n_steps)


def train_half_adam(recorder=None, trial: Trial | None = None, steps: int = 12,
                    scale: float = 1e-3, unfreeze_at: int | None = None,
                    losses: list | None = None):
    """``model.half()`` + ``Adam(eps=1e-8)``: float16 rounds eps to 0, and a gradient whose
    square flushes to 0 makes ``m / (sqrt(v) + eps)`` a division by 0. ``unfreeze_at``: the
    body is frozen until that step (linear probing, then fine-tuning the whole model). The
    step whose update made the weights non-finite, or None; ``losses`` gets each step's."""
    losses = [] if losses is None else losses
    trial = trial or Trial()
    model = make_rate_head().half()
    if unfreeze_at is not None:
        model.body.requires_grad_(False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-8)
    crit = nn.MSELoss()
    with recorder(model, opt, crit) if recorder else _nothing():
        for step, (x, y) in enumerate(half_batches(steps, scale)):
            if step == unfreeze_at:
                model.body.requires_grad_(True)
            if step == trial.start:
                trial.apply(opt)
                if trial.dtype is not None:
                    to_dtype(model, opt, trial.dtype)
            dtype = next(model.parameters()).dtype
            opt.zero_grad()
            loss = crit(model(x.to(dtype)), y.to(dtype))
            losses.append(loss.item())
            loss.backward()
            if trial.on(step) and trial.clip is not None:
                nn.utils.clip_grad_norm_(model.parameters(), trial.clip)
            opt.step()
            if not all(torch.isfinite(p).all() for p in model.parameters()):
                return step
    return None


# --- 2. a learning rate that diverges over a few steps --------------------------------------

def make_mlp() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 1))


def regression_loader(n_steps: int, seed: int = 21):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(POOL * BATCH, D_IN, generator=g)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(POOL * BATCH, 1, generator=g)
    return _loader(x, y, n_steps)


def train_sgd(recorder=None, trial: Trial | None = None, lr: float = 0.08,
              weight_decay: float = 0.0, steps: int = 60):
    """SGD on a regression MLP; returns the step whose loss or weights first went non-finite
    (None: finite throughout)."""
    trial = trial or Trial()
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=weight_decay)
    crit = nn.MSELoss()
    return fit_plainly(model, opt, crit, regression_loader(steps), recorder, trial)


def fit_plainly(model, opt, crit, batches, recorder, trial: Trial) -> int | None:
    """The plain loop (the trial's change from its start step, its clip after backward) over
    ``batches``, under ``recorder`` if given; the step whose loss went non-finite, or None."""
    with recorder(model, opt, crit) if recorder else _nothing():
        for step, (x, y) in enumerate(batches):
            if step == trial.start:
                trial.apply(opt)
            opt.zero_grad()
            loss = crit(model(x), y)
            if not math.isfinite(loss.item()):
                return step
            loss.backward()
            if trial.on(step) and trial.clip is not None:
                nn.utils.clip_grad_norm_(model.parameters(), trial.clip)
            opt.step()
    return None

# --- 3. log(0) in a log-space loss ------------------------------------------------------------


class LogMSE(nn.Module):
    """Weighted mean squared error of logarithms (counts, prices, durations spanning decades):
    a user's loss, ``log(pred) - log(target)``, with no ``log1p`` and no floor, each record
    weighted by its exposure."""

    def forward(self, pred, target, weight):
        err = (torch.log(pred) - torch.log(target)) ** 2  # log(0) of a target 0
        return (weight * err).sum() / weight.sum()


class PositiveHead(nn.Module):
    """A rate head over features some records lack (``present``: 1 where observed)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2 * D_IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 1))

    def forward(self, x, present):
        return F.softplus(self.net(torch.cat([x * present, present], dim=1))) + 1e-3


def make_positive_head() -> nn.Module:
    torch.manual_seed(2)
    return PositiveHead()


ZERO_ROWS = (3, 9)  # the batch rows of step BAD_STEP whose target is 0 (a count of nothing)
BAD_STEP = 4


def count_batches(n_steps: int):
    """(features, present mask, target, exposure weight) of the first ``n_steps`` batches."""
    g = torch.Generator().manual_seed(31)
    x = torch.randn(POOL * BATCH, D_IN, generator=g)
    present = (torch.rand(POOL * BATCH, D_IN, generator=g) > 0.2).float()
    weight = 0.5 + torch.rand(POOL * BATCH, 1, generator=g)
    y = torch.exp(0.5 * x[:, :1]) + 0.1
    for r in ZERO_ROWS:
        y[BAD_STEP * BATCH + r] = 0.0
    n = n_steps * BATCH
    return TensorDataset(x[:n], present[:n], y[:n], weight[:n])


def train_log_mse(recorder=None, drop: tuple[int, ...] = (), trial: Trial | None = None,
                  steps: int = 8, losses: list | None = None):
    """Adam on a positive regression head with ``LogMSE``; ``drop`` removes those rows of step
    BAD_STEP's batch (``--try drop=``). The step whose loss went non-finite, or None;
    ``losses`` gets each step's."""
    trial = trial or Trial()
    losses = [] if losses is None else losses
    model = make_positive_head()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    crit = LogMSE()
    loader = DataLoader(count_batches(steps), batch_size=BATCH, shuffle=False)
    with recorder(model, opt, crit) if recorder else _nothing():
        for step, batch in enumerate(loader):
            if step == BAD_STEP and drop:
                keep = [i for i in range(BATCH) if i not in drop]
                batch = [t[keep] for t in batch]
            if step == trial.start and trial.dtype is not None:
                to_dtype(model, opt, trial.dtype)
            x, present, y, w = (t.to(trial.dtype) if trial.on(step) and trial.dtype else t
                                for t in batch)
            opt.zero_grad()
            loss = crit(model(x, present), y, w)
            losses.append(loss.item())
            if not math.isfinite(loss.item()):
                return step
            loss.backward()
            opt.step()
    return None


# --- 4. exp overflow under float16 autocast --------------------------------------------------

class PoissonRate(nn.Module):
    """A count model's rate ``exp(eta)`` fed to a float16 projection under autocast: a rate
    above 65504 (an ``eta`` above 11) is Inf in float16."""

    def __init__(self):
        super().__init__()
        self.eta = nn.Linear(D_IN, 4)
        self.proj = nn.Linear(4, 1)

    def forward(self, x):
        rate = torch.exp(self.eta(x))
        return self.proj(rate)


def make_poisson_rate() -> nn.Module:
    torch.manual_seed(3)
    m = PoissonRate()
    with torch.no_grad():
        m.eta.weight.mul_(4.0)  # an init too wide for exp
    return m


HOT_ROW = 5  # the record of step 2's batch whose features are far out


def event_batches(n_steps: int):
    g = torch.Generator().manual_seed(41)
    x = torch.randn(POOL * BATCH, D_IN, generator=g).clamp(-1, 1)
    y = torch.rand(POOL * BATCH, 1, generator=g)
    x[2 * BATCH + HOT_ROW] = 2.0 * torch.tensor([-1., -1, -1, -1, -1, -1, 1, 1])
    return _loader(x, y, n_steps)


def train_autocast(recorder=None, trial: Trial | None = None, steps: int = 6):
    """float16 autocast on the CPU; ``trial.dtype`` from ``trial.start`` on runs without it in
    that type. The step whose loss went non-finite, or None."""
    trial = trial or Trial()
    model = make_poisson_rate()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    crit = nn.MSELoss()
    with recorder(model, opt, crit) if recorder else _nothing():
        for step, (x, y) in enumerate(event_batches(steps)):
            wide = trial.on(step) and trial.dtype is not None
            if step == trial.start and wide:
                to_dtype(model, opt, trial.dtype)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16, enabled=not wide):
                out = model(x.to(trial.dtype) if wide else x)
            loss = crit(out.float(), y.to(out.dtype).float())
            if not math.isfinite(loss.item()):
                return step
            loss.backward()
            opt.step()
    return None


# --- 5. exploding gradients through a recurrence, no clipping --------------------------------

class SequenceRegressor(nn.Module):
    """A ReLU RNN over a sequence, its last state to one output."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.RNN(4, HIDDEN, nonlinearity="relu", batch_first=True)
        self.head = nn.Linear(HIDDEN, 1)

    def forward(self, x, lengths=None):
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


def make_sequence_regressor() -> nn.Module:
    torch.manual_seed(4)
    m = SequenceRegressor()
    with torch.no_grad():
        m.rnn.weight_hh_l0.copy_(torch.eye(HIDDEN))  # an identity init (IRNN)
    return m


SPIKE_STEP, SPIKE_SCALE = 6, 30.0


def sequence_loader(n_steps: int, length: int = 40):
    g = torch.Generator().manual_seed(51)
    x = torch.rand(POOL * BATCH, length, 4, generator=g)
    x[SPIKE_STEP * BATCH:(SPIKE_STEP + 1) * BATCH] *= SPIKE_SCALE  # a batch of loud recordings
    y = x.sum(dim=(1, 2)).unsqueeze(1) / 10
    return _loader(x, y, n_steps)


RNN_LR = 2e-5


def train_rnn(recorder=None, trial: Trial | None = None, steps: int = 40):
    """SGD on the ReLU RNN, no clipping; returns the step whose loss went non-finite."""
    trial = trial or Trial()
    model = make_sequence_regressor()
    opt = torch.optim.SGD(model.parameters(), lr=RNN_LR)
    crit = nn.MSELoss()
    return fit_plainly(model, opt, crit, sequence_loader(steps), recorder, trial)


def _loader(x, y, n_steps: int):
    n = n_steps * BATCH
    return DataLoader(TensorDataset(x[:n], y[:n]), batch_size=BATCH, shuffle=False)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# --- 6. a count model's rate growing past float16's range under AMP ---------------------------

class CountModel(nn.Module):
    """Page views per hour: a log-rate head, its rate ``exp(eta)`` returned for a Poisson
    loss on rates (``log_input=False``), computed under float16 autocast."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.Tanh())
        self.eta = nn.Linear(HIDDEN, 1)

    def forward(self, x):
        return torch.exp(self.eta(self.body(x)))  # > 65504 in float16 once eta > 11.09


def make_count_model() -> nn.Module:
    torch.manual_seed(6)
    return CountModel()


def count_loader(n_steps: int):
    """Hourly page views: log-normal counts whose busiest hours pass 65504."""
    g = torch.Generator().manual_seed(61)
    x = torch.randn(POOL * BATCH, D_IN, generator=g)
    y = torch.exp(9.0 + 1.2 * x[:, :1].clamp(-3, 3)).round()
    return _loader(x, y, n_steps)


def train_counts(recorder=None, trial: Trial | None = None, steps: int = 40,
                 losses: list | None = None):
    """Adam under float16 autocast with a GradScaler; ``trial.dtype`` from ``trial.start`` on
    runs without autocast in that type. The step whose loss went non-finite, or None."""
    trial = trial or Trial()
    losses = [] if losses is None else losses
    model = make_count_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    crit = nn.PoissonNLLLoss(log_input=False)
    with recorder(model, opt, crit, scaler=scaler) if recorder else _nothing():
        for step, (x, y) in enumerate(count_loader(steps)):
            if step == trial.start:
                trial.apply(opt)
                if trial.dtype is not None:
                    to_dtype(model, opt, trial.dtype)
            wide = trial.on(step) and trial.dtype is not None
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16, enabled=not wide):
                rate = model(x.to(trial.dtype) if wide else x)
            loss = crit(rate.float(), y)
            losses.append(loss.item())
            if not math.isfinite(loss.item()):
                return step
            scaler.scale(loss).backward()
            if trial.on(step) and trial.clip is not None:
                scaler.unscale_(opt)
                nn.utils.clip_grad_norm_(model.parameters(), trial.clip)
            scaler.step(opt)
            scaler.update()
    return None


# --- 7. log of a softmax that underflowed, in a label-smoothed loss ---------------------------

class SmoothedCE(nn.Module):
    """Label-smoothed cross entropy written out: ``log(softmax(z))`` of a class whose
    probability float32 rounds to 0 is -inf, and its smoothing weight keeps it in the sum."""

    def forward(self, z, y):
        t = torch.full_like(z, 0.1 / (z.shape[1] - 1)).scatter(1, y[:, None], 0.9)
        return -(t * torch.log(torch.softmax(z, -1))).sum(-1).mean()  # log(0) of an underflow


def make_classifier() -> nn.Module:
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 10))


def class_batches(n_steps: int):
    g = torch.Generator().manual_seed(71)
    x = 3 * torch.randn(POOL * BATCH, D_IN, generator=g)
    return _loader(x, torch.randint(0, 10, (POOL * BATCH,), generator=g), n_steps)


def train_smoothed(recorder=None, trial: Trial | None = None, steps: int = 30,
                   losses: list | None = None):
    """SGD at a rate that drives the logits apart until a softmax underflows."""
    trial = trial or Trial()
    losses = [] if losses is None else losses
    model = make_classifier()
    opt = torch.optim.SGD(model.parameters(), lr=2.0)
    crit = SmoothedCE()
    with recorder(model, opt, crit) if recorder else _nothing():
        for step, (x, y) in enumerate(class_batches(steps)):
            if step == trial.start:
                trial.apply(opt)
                if trial.dtype is not None:
                    to_dtype(model, opt, trial.dtype)
            if trial.on(step) and trial.dtype is not None:
                x = x.to(trial.dtype)
            opt.zero_grad()
            loss = crit(model(x), y)
            losses.append(loss.item())
            if not math.isfinite(loss.item()):
                return step
            loss.backward()
            if trial.on(step) and trial.clip is not None:
                nn.utils.clip_grad_norm_(model.parameters(), trial.clip)
            opt.step()
    return None
