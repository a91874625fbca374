"""Probabilistic time-series forecasting with pytorch-forecasting (1.8) on Lightning.

Retail-style panels (a few stores' daily sales with a price covariate) in a pandas DataFrame,
turned into a ``TimeSeriesDataSet`` with group ids, ``time_idx``, known and unknown reals and a
target normalizer; DeepAR, NHiTS and the Temporal Fusion Transformer built ``from_dataset`` with
their usual metrics (``NormalDistributionLoss``, ``QuantileLoss``) or a metric of the user's
(``MultiHorizonMetric``/``MASE`` subclasses), trained by ``lightning.pytorch.Trainer`` on the
CPU with the project's ``FlightRecorderCallback``.
"""

from __future__ import annotations

import math
import warnings

import lightning.pytorch as pl
import numpy as np
import pandas as pd
import torch
from pytorch_forecasting import DeepAR, NHiTS, TemporalFusionTransformer, TimeSeriesDataSet
from pytorch_forecasting.data import GroupNormalizer, TorchNormalizer
from pytorch_forecasting.metrics import MAE, MASE, RMSE, NormalDistributionLoss, QuantileLoss
from pytorch_forecasting.metrics.base_metrics import MultiHorizonMetric
from pytorch_forecasting.models import BaseModel
from torch import nn

ENC, DEC, BATCH = 12, 4, 8


def sales_frame(n_series: int = 4, length: int = 40, seed: int = 0,
                zero_at: tuple[int, int] | None = None,
                constant_series: int | None = None,
                flagship: int | None = None) -> pd.DataFrame:
    """Daily sales of ``n_series`` stores with a price covariate; ``zero_at=(store, day)``: the
    store was closed that day (0 sold); ``constant_series``: a product never sold there (all 0)."""
    rng = np.random.default_rng(seed)
    rows = []
    for g in range(n_series):
        level = 10.0 + 5.0 * g
        for t in range(length):
            sales = level + 3.0 * math.sin(t / 5.0 + g) + rng.normal(0.0, 0.5)
            if flagship == g:
                sales *= 1000.0
            if constant_series == g:
                sales = 0.0
            if zero_at is not None and tuple(zero_at) == (g, t):
                sales = 0.0
            rows.append({"store": str(g), "time_idx": t, "sales": sales,
                         "price": 1.0 + 0.1 * math.sin(t / 3.0) + 0.01 * g})
    return pd.DataFrame(rows)


def dataset(frame: pd.DataFrame, normalizer=None) -> TimeSeriesDataSet:
    if normalizer is None:
        normalizer = GroupNormalizer(groups=["store"], transformation="softplus")
    return TimeSeriesDataSet(
        frame, time_idx="time_idx", target="sales", group_ids=["store"],
        max_encoder_length=ENC, max_prediction_length=DEC,
        static_categoricals=["store"], time_varying_known_reals=["time_idx", "price"],
        time_varying_unknown_reals=["sales"], target_normalizer=normalizer,
        add_relative_time_idx=False, add_target_scales=True)


def loader(ds: TimeSeriesDataSet):
    torch.manual_seed(0)
    return ds.to_dataloader(train=True, batch_size=BATCH, num_workers=0)


# --- the user's metrics ---------------------------------------------------------------------

class RMSSE(MASE):
    """M5's root mean squared scaled error: the error scaled by the RMS of the series' own
    one-step differences over the encoder window (no eps: a series that never moved has 0)."""

    @staticmethod
    def calculate_scaling(target, lengths, encoder_target, encoder_lengths):
        diffs = encoder_target[:, 1:] - encoder_target[:, :-1]
        return diffs.pow(2).mean(dim=1).sqrt()

    def loss(self, y_pred, target, scaling):
        return (self.to_prediction(y_pred) - target).pow(2) / scaling.unsqueeze(-1).pow(2)


class GaussianLikelihood(MultiHorizonMetric):
    """A Gaussian NLL written from the density: ``-log(pdf)`` (the pdf underflows to 0 once the
    error is ~14 scales, and its log is -inf)."""

    def to_prediction(self, y_pred):
        return y_pred[..., 0]

    def loss(self, y_pred, target):
        mu, sigma = y_pred[..., 0], torch.nn.functional.softplus(y_pred[..., 1]) * 0.05
        pdf = torch.exp(-0.5 * ((target - mu) / sigma) ** 2) / (sigma * math.sqrt(2 * math.pi))
        return -torch.log(pdf)


# --- models ---------------------------------------------------------------------------------

def _normalizer(transformation: str | None):
    return GroupNormalizer(groups=["store"], transformation=transformation)


LOSSES = {"mae": MAE, "rmse": RMSE, "mase": MASE, "rmsse": RMSSE, "quantile": QuantileLoss, "gaussian": GaussianLikelihood}


def make_deepar(transformation: str | None = "softplus", lr: float = 1e-2):
    ds = dataset(sales_frame(), _normalizer(transformation))
    torch.manual_seed(0)
    return DeepAR.from_dataset(ds, hidden_size=8, rnn_layers=1, learning_rate=lr,
                               loss=NormalDistributionLoss())


def make_nhits(transformation: str | None = "softplus", loss: str = "mase", lr: float = 1e-2):
    ds = dataset(sales_frame(), _normalizer(transformation))
    torch.manual_seed(0)
    return NHiTS.from_dataset(ds, hidden_size=8, n_blocks=[1, 1], n_layers=1,
                              learning_rate=lr, loss=LOSSES[loss](),
                              optimizer="adam")


def make_tft(transformation: str | None = "softplus", loss: str = "quantile", lr: float = 1e-2):
    ds = dataset(sales_frame(), _normalizer(transformation))
    torch.manual_seed(0)
    return TemporalFusionTransformer.from_dataset(
        ds, hidden_size=8, attention_head_size=1, hidden_continuous_size=4, dropout=0.1,
        learning_rate=lr, loss=LOSSES[loss](), optimizer="adam",
        output_size=2 if loss == "gaussian" else 7)


# --- a model of the user's: pytorch-forecasting's "implementing new architectures" MLP, with
# reversible instance normalisation (RevIN) of each encoder window ---------------------------

class RevIN(nn.Module):
    """Each window standardised by its own mean and std (``eps`` added to the std: 0 gives 0/0
    for a window that never moves; added after the sqrt it leaves sqrt's backward at 0)."""

    def __init__(self, eps: float = 0.0):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        mean = x.mean(dim=1, keepdim=True)
        std = ((x - mean) ** 2).mean(dim=1, keepdim=True).sqrt() + self.eps
        return (x - mean) / std, mean, std


class WindowMLP(BaseModel):
    def __init__(self, input_size: int, output_size: int, hidden_size: int = 16,
                 eps: float = 0.0, log_link: bool = False, **kwargs):
        self.save_hyperparameters()
        super().__init__(**kwargs)
        self.log_link = log_link  # the window as given, predicting the log of the sales
        self.revin = RevIN(eps)
        self.net = nn.Sequential(nn.Linear(input_size, hidden_size), nn.ReLU(),
                                 nn.Linear(hidden_size, output_size))

    def forward(self, x):
        if self.log_link:
            prediction = torch.exp(self.net(x["encoder_cont"][..., 0]))
            prediction = self.transform_output(prediction, target_scale=x["target_scale"])
            return self.to_network_output(prediction=prediction)
        window, mean, std = self.revin(x["encoder_cont"][..., 0])
        prediction = self.net(window) * std + mean
        prediction = self.transform_output(prediction, target_scale=x["target_scale"])
        return self.to_network_output(prediction=prediction)

    @classmethod
    def from_dataset(cls, dataset, **kwargs):
        return super().from_dataset(dataset, input_size=dataset.max_encoder_length,
                                    output_size=dataset.max_prediction_length, **kwargs)


def window_dataset(frame: pd.DataFrame, raw: bool = False) -> TimeSeriesDataSet:
    """``raw``: the sales as recorded (``TorchNormalizer(method="identity")``), for a model
    with a log link."""
    normalizer = TorchNormalizer(method="identity") if raw else GroupNormalizer(groups=["store"])
    return TimeSeriesDataSet(
        frame, time_idx="time_idx", target="sales", group_ids=["store"],
        max_encoder_length=ENC, max_prediction_length=DEC, time_varying_unknown_reals=["sales"],
        target_normalizer=normalizer)


def make_window_mlp(eps: float = 0.0, loss: str = "mae", lr: float = 1e-2,
                    optimizer: str = "adam", log_link: bool = False):
    torch.manual_seed(0)
    return WindowMLP.from_dataset(window_dataset(sales_frame(), raw=log_link), eps=eps,
                                  loss=LOSSES[loss](), learning_rate=lr, optimizer=optimizer,
                                  log_link=log_link)


def fit(model, ds: TimeSeriesDataSet, callbacks=(), max_steps: int = 6, clip: float | None = 0.1,
        **trainer_args):
    """``Trainer.fit`` as a forecaster runs it (CPU, few steps, gradient clipping)."""
    pl.seed_everything(0, verbose=False)
    with warnings.catch_warnings():
        # Lightning's advice (workers, logging), not the run's ("Loss is not finite" stays)
        warnings.filterwarnings("ignore", category=UserWarning, module="lightning")
        warnings.filterwarnings("ignore", category=RuntimeWarning, module="lightning")
        warnings.filterwarnings("ignore", category=FutureWarning)  # (Lightning's pytree shim)
        trainer = pl.Trainer(accelerator="cpu", max_steps=max_steps, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, callbacks=list(callbacks),
                             gradient_clip_val=clip, **trainer_args)
        trainer.fit(model, loader(ds))
    return trainer
