"""LightningModules whose training_step computes its loss inline, for the outside-loss tests:
``replay_models.LogNet`` regressed onto one-hot targets with ``F.mse_loss``."""

from __future__ import annotations

import lightning as L
import replay_models as R
import torch
import torch.nn.functional as F


class InlineMSE(L.LightningModule):
    """``return F.mse_loss(self.net(x), y)``: a missing target (NaN) makes the loss and the
    gradient of that row's prediction NaN; the model itself stays finite."""

    def __init__(self):
        super().__init__()
        self.net = R.make_log_net()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class Targets(torch.utils.data.Dataset):
    """``replay_models.batch`` rows with one-hot float targets; items in ``missing`` have a NaN
    target (a label the data never had). Item 8 * k + j is sample j of step k (batch 8)."""

    def __init__(self, n: int = 64, missing=()):
        self.n, self.missing = n, set(missing)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        x, y = R.batch(i, n=1)
        target = F.one_hot(y[0], R.N_CLASSES).float()
        if i in self.missing:
            target[1] = float("nan")
        return x[0], target


class HandBCE(torch.nn.Module):
    """Binary cross-entropy written out on ``sigmoid``: its ``log`` meets 0 once the logits
    leave sigmoid's range (``BCEWithLogitsLoss`` computes in log space)."""

    def forward(self, logits, y):
        p = torch.sigmoid(logits)
        return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()


def make_tower() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                               torch.nn.ReLU(), torch.nn.Linear(64, 1), torch.nn.Flatten(0))


class ClickTower(L.LightningModule):
    """A click-through-rate tower trained with :class:`HandBCE` and Adam at ``lr``."""

    def __init__(self, lr: float):
        super().__init__()
        self.model, self.criterion, self.lr = make_tower(), HandBCE(), lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.criterion(self.model(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def clicks(n: int = 256) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(n, 16, generator=g),
                                          (torch.rand(n, generator=g) < 0.3).float())
