"""Tabular deep learning as practitioners train it through skorch 1.4 and pytorch-tabnet 4.1.

skorch: a ``NeuralNetClassifier``/``NeuralNetRegressor`` fit on numpy arrays, the recorder
attached from a custom skorch ``Callback`` (``on_train_begin``: ``net.module_``,
``net.optimizer_``, ``net.criterion_``; ``on_train_end``: detach), beside skorch's own
``EpochScoring``, ``LRScheduler`` and ``GradientNormClipping``. TabNet: a ``TabNetClassifier`` /
``TabNetRegressor`` fit with its own loop, the recorder attached to ``clf.network`` and
``clf._optimizer`` from a pytorch-tabnet ``Callback``.

The data generators plant what tabular data really holds: a missing value left as NaN in a
numpy column, a constant column standardised by its std of 0, a target with an inf, a class
absent from the split the class weights were counted on (``n / (k * 0)``), count targets of 0
under a hand-written Poisson deviance, a column of nanosecond timestamps.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from skorch import NeuralNetRegressor
from skorch.callbacks import Callback
from skorch.dataset import unpack_data
from torch import nn

from recorder import FlightRecorder

with warnings.catch_warnings():
    # (pytorch-tabnet 4.1 imports scipy.sparse.base, deprecated since SciPy 1.8)
    warnings.simplefilter("ignore", DeprecationWarning)
    from pytorch_tabnet.callbacks import Callback as TabNetCallback
    from pytorch_tabnet.tab_model import TabNetClassifier, TabNetRegressor

N_FEATURES = 6
N_CLASSES = 3


# ---------------------------------------------------------------- data

def tabular(n: int = 256, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Features (float32, as skorch wants them), class labels (int64), a count target."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, N_FEATURES)).astype(np.float32)
    score = X[:, 0] - 0.5 * X[:, 1] + 0.3 * X[:, 2]
    y = np.digitize(score, [-0.5, 0.5]).astype(np.int64)
    counts = rng.poisson(np.exp(0.3 * X[:, 0])).astype(np.float32)
    return X, y, counts


def with_missing(X: np.ndarray, rows: list[int], col: int = 3) -> np.ndarray:
    """A missing value left as NaN (``pd.read_csv`` of an empty cell, ``.values``)."""
    X = X.copy()
    X[rows, col] = np.nan
    return X


def constant_column(X: np.ndarray, col: int = 4, value: float = 1.0) -> np.ndarray:
    """A column that is the same in every row (a flag set for all records)."""
    X = X.copy()
    X[:, col] = value
    return X


def column_stats(X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``StandardScaler``'s statistics taken by hand: no guard against a std of 0."""
    return X.mean(0).astype(np.float32), X.std(0).astype(np.float32)


def class_weights(y: np.ndarray, k: int = N_CLASSES) -> np.ndarray:
    """sklearn's ``'balanced'`` formula ``n / (k * count)``, counted on the rows at hand."""
    counts = np.bincount(y, minlength=k).astype(np.float32)
    with np.errstate(divide="ignore"):
        return (len(y) / (k * counts)).astype(np.float32)


def unix_seconds(X: np.ndarray, col: int = 5) -> np.ndarray:
    """A datetime column as float32 unix seconds (``df.ts.astype('int64') / 1e9``): ~1.7e9,
    records a minute apart."""
    X = X.copy()
    X[:, col] = (1.7e9 + np.arange(len(X)) * 60.0).astype(np.float32)
    return X


def nanosecond_timestamps(X: np.ndarray, col: int = 5, missing_every: int = 2) -> np.ndarray:
    """A datetime column cast to int64 nanoseconds (``df.ts.astype('int64')``), its missing
    entries filled with 0: a column of ~1.7e18 and 0."""
    X = X.copy().astype(np.float32)
    ts = 1.7e18 + np.arange(len(X), dtype=np.float64) * 3.6e12
    ts[::missing_every] = 0.0
    X[:, col] = ts.astype(np.float32)
    return X


# ---------------------------------------------------------------- skorch modules

class Standardize(nn.Module):
    """A scaler fit on the training set, inside the module (shipped with the model)."""

    def __init__(self, mean, std):
        super().__init__()
        self.register_buffer("mean", torch.as_tensor(mean, dtype=torch.float32))
        self.register_buffer("std", torch.as_tensor(std, dtype=torch.float32))

    def forward(self, x):
        return (x - self.mean) / self.std


class MLPClassifier(nn.Module):
    """skorch's tutorial classifier: softmax probabilities for its NLLLoss."""

    def __init__(self, n_in: int = N_FEATURES, hidden: int = 16, n_classes: int = N_CLASSES,
                 mean=None, std=None):
        super().__init__()
        mean = np.zeros(n_in, np.float32) if mean is None else mean
        std = np.ones(n_in, np.float32) if std is None else std
        self.scaler = Standardize(mean, std)
        self.hidden = nn.Linear(n_in, hidden)
        self.act = nn.ReLU()
        self.dropout = nn.Dropout(0.1)
        self.output = nn.Linear(hidden, n_classes)

    def forward(self, X):
        h = self.dropout(self.act(self.hidden(self.scaler(X))))
        return torch.softmax(self.output(h), dim=-1)


class LogitsClassifier(MLPClassifier):
    """The same network returning logits, for a ``CrossEntropyLoss`` criterion."""

    def forward(self, X):
        h = self.dropout(self.act(self.hidden(self.scaler(X))))
        return self.output(h)


class MLPRegressor(nn.Module):
    """A regressor with a log link for count targets (``rate = exp(eta)``) or identity."""

    def __init__(self, n_in: int = N_FEATURES, hidden: int = 16, log_link: bool = False):
        super().__init__()
        self.log_link = log_link
        self.body = nn.Sequential(nn.Linear(n_in, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, X):
        eta = self.body(X)
        return torch.exp(eta) if self.log_link else eta


class BatchStandardize(nn.Module):
    """Standardise each column by the batch's own statistics, the variance in one pass
    (``E[x^2] - E[x]^2``, as a streaming scaler keeps it)."""

    def forward(self, x):
        mean = x.mean(0)
        var = (x * x).mean(0) - mean * mean
        return (x - mean) / torch.sqrt(var + 1e-6)


class BatchNormedRegressor(nn.Module):
    def __init__(self, n_in: int = N_FEATURES, hidden: int = 16):
        super().__init__()
        self.norm = BatchStandardize()
        self.body = nn.Sequential(nn.Linear(n_in, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, X):
        return self.body(self.norm(X))


class PoissonDeviance(nn.Module):
    """The unit Poisson deviance written from the textbook, ``2 * (y log(y/mu) - (y - mu))``,
    with the ``y = 0`` term set to 0 by ``torch.where`` (its limit)."""

    def forward(self, mu, y):
        y = y.view_as(mu)
        term = torch.where(y > 0, y * torch.log(y / mu), torch.zeros_like(mu))
        return (2 * (term - (y - mu))).mean()


def make_classifier():
    torch.manual_seed(0)
    return MLPClassifier()


def make_scaled_classifier():
    """The classifier whose scaler holds the training set's statistics (the replay loads the
    bundle's buffers over these)."""
    torch.manual_seed(0)
    return MLPClassifier()


def make_logits_classifier():
    torch.manual_seed(0)
    return LogitsClassifier()


def make_regressor():
    torch.manual_seed(0)
    return MLPRegressor()


def make_count_regressor():
    torch.manual_seed(0)
    return MLPRegressor(log_link=True)


def make_batch_normed_regressor():
    torch.manual_seed(0)
    return BatchNormedRegressor()


class AutocastRegressor(NeuralNetRegressor):
    """skorch's documented way to change the step: override ``train_step_single``, here to
    run the forward and the loss under autocast (float16)."""

    def train_step_single(self, batch, **fit_params):
        self._set_training(True)
        Xi, yi = unpack_data(batch)
        with torch.autocast("cpu", dtype=torch.float16):
            y_pred = self.infer(Xi, **fit_params)
            loss = self.get_loss(y_pred.float(), yi, X=Xi, training=True)
        loss.backward()
        return {"loss": loss, "y_pred": y_pred}


# ---------------------------------------------------------------- skorch callback

class RecordTraining(Callback):
    """Attach the flight recorder to the net's own module, optimizer and criterion."""

    def __init__(self, out_dir, factory: str):
        self.out_dir = out_dir
        self.factory = factory
        self.recorder = None

    def on_train_begin(self, net, X=None, y=None, **kwargs):
        self.recorder = FlightRecorder(net.module_, net.optimizer_, loss_fn=net.criterion_,
                                       out_dir=self.out_dir, factory=self.factory).attach()

    def on_train_end(self, net, X=None, y=None, **kwargs):
        if self.recorder is not None:
            self.recorder.end_step()
            self.recorder.detach()
            self.recorder = None


# ---------------------------------------------------------------- TabNet

TABNET = dict(n_d=4, n_a=4, n_steps=2, n_independent=1, n_shared=1, seed=0, verbose=0)
VIRTUAL_BATCH = 16   # fit(virtual_batch_size=...): Ghost BatchNorm's chunks


def tabnet_network(kind: str = "classifier", input_dim: int = N_FEATURES,
                   output_dim: int = N_CLASSES, **params):
    """The ``TabNet`` module ``fit`` builds (``_set_network``), for the replay's factory."""
    cls = TabNetClassifier if kind == "classifier" else TabNetRegressor
    clf = cls(**{**TABNET, **params})
    clf.input_dim, clf.output_dim = input_dim, output_dim
    clf.virtual_batch_size = VIRTUAL_BATCH
    clf._set_network()
    return clf.network


class TabNetRecord(TabNetCallback):
    """pytorch-tabnet's callback: the network and optimizer exist at ``on_train_begin``."""

    def __init__(self, out_dir, factory: str, factory_kwargs=None, wrap_loss: bool = False):
        super().__init__()
        self.out_dir, self.factory, self.factory_kwargs = out_dir, factory, factory_kwargs
        self.wrap_loss = wrap_loss
        self.recorder = None

    def on_train_begin(self, logs=None):
        """``wrap_loss``: give the recorder TabNet's loss function and put ``rec.loss_fn`` in
        its place (``compute_loss`` calls ``self.loss_fn``), else record without a loss."""
        tr = self.trainer
        self.recorder = FlightRecorder(tr.network, tr._optimizer,
                                       loss_fn=tr.loss_fn if self.wrap_loss else None,
                                       out_dir=self.out_dir, factory=self.factory,
                                       factory_kwargs=self.factory_kwargs).attach()
        if self.wrap_loss:
            tr.loss_fn = self.recorder.loss_fn

    def on_train_end(self, logs=None):
        if self.recorder is not None:
            self.recorder.end_step()
            self.recorder.detach()
            self.recorder = None


# ---------------------------------------------------------------- more skorch modules

class DictInputClassifier(nn.Module):
    """skorch passes a dict X as keyword arguments: numeric features and a categorical code."""

    def __init__(self, n_num: int = N_FEATURES - 1, n_cat: int = 4, hidden: int = 16):
        super().__init__()
        self.emb = nn.Embedding(n_cat, 3)
        self.hidden = nn.Linear(n_num + 3, hidden)
        self.output = nn.Linear(hidden, N_CLASSES)

    def forward(self, x_num, x_cat):
        h = torch.cat([x_num, self.emb(x_cat)], dim=1)
        return torch.softmax(self.output(torch.relu(self.hidden(h))), dim=-1)


def make_dict_classifier():
    torch.manual_seed(0)
    return DictInputClassifier()


class LogProbClassifier(LogitsClassifier):
    """Log-probabilities for ``NLLLoss`` taken as ``log(softmax)``."""

    def forward(self, X):
        return torch.log(torch.softmax(super().forward(X), dim=-1))


def make_log_prob_classifier():
    torch.manual_seed(0)
    return LogProbClassifier()


class GradAccRegressor(NeuralNetRegressor):
    """skorch's FAQ recipe for gradient accumulation: ``train_step`` overridden to step the
    optimizer every ``acc_steps`` batches, the loss divided by ``acc_steps``."""

    def __init__(self, *args, acc_steps: int = 2, **kwargs):
        super().__init__(*args, **kwargs)
        self.acc_steps = acc_steps

    def get_loss(self, *args, **kwargs):
        return super().get_loss(*args, **kwargs) / self.acc_steps

    def train_step(self, batch, **fit_params):
        step = self.train_step_single(batch, **fit_params)
        self.n_seen_ = getattr(self, "n_seen_", 0) + 1
        if self.n_seen_ % self.acc_steps == 0:
            self.optimizer_.step()
            self.optimizer_.zero_grad()
        return step


class CheckedClassifier(LogitsClassifier):
    """The logits classifier with the guard users add after a NaN run: it raises inside the
    forward, before the module returns (no hook sees the value)."""

    def forward(self, X):
        logits = super().forward(X)
        if torch.isnan(logits).any():
            raise ValueError("NaN in logits")
        return logits


def make_checked_classifier():
    torch.manual_seed(0)
    return CheckedClassifier()
