"""LightningModules for the Lightning callback tests: ``replay_models.LogNet`` (log of a value
that goes negative when a sample is scaled up) trained through Lightning's loop."""

from __future__ import annotations

import lightning as L
import objective_models as O
import replay_models as R
import torch
from torch import nn


class LogNetModule(L.LightningModule):
    """Its training_step calls ``self.net`` (record it with ``module="net"``); the loss module
    is the attribute ``crit``."""

    def __init__(self, optimizers: int = 1):
        super().__init__()
        self.net = R.make_log_net()
        self.crit = nn.CrossEntropyLoss()
        self.n_optimizers = optimizers
        self.automatic_optimization = optimizers == 1

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.crit(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", self.crit(self.net(x), y))

    def configure_optimizers(self):
        opts = [torch.optim.SGD(self.parameters(), lr=0.05) for _ in range(self.n_optimizers)]
        return opts[0] if len(opts) == 1 else opts


class LearnedTemperature(LogNetModule):
    """Its loss module holds a learned temperature, trained by ``self.parameters()``'s
    optimizer with the network (a submodule beside ``net``, as CLIP-style code keeps it)."""

    def __init__(self):
        super().__init__()
        self.crit = O.LearnedTemperatureCE()


class InlineLoss(LogNetModule):
    """A training_step that computes its loss inline with ``F.cross_entropy`` (no loss
    module the recorder could hook)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)


class Guarded(LogNetModule):
    """A training_step with its own NaN guard: it raises before Lightning's backward and the
    optimizer step that would have closed the recorder's step."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if not torch.isfinite(loss):
            raise ValueError(f"non-finite loss at batch {batch_idx}")
        return loss


class Forwarding(LogNetModule):
    """A LightningModule whose training_step runs its own forward (``self(x)``)."""

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.crit(self(x), y)


def make_forwarding() -> Forwarding:
    return Forwarding()


class Rows(torch.utils.data.Dataset):
    """``replay_models.batch`` rows, one per item; the items in ``scaled`` are multiplied by 100,
    those in ``ignored`` get the target -100 (cross-entropy's ``ignore_index``); with batch
    size 8, item 8 * k + j is sample j of step k."""

    def __init__(self, n: int = 64, scaled=(), ignored=()):
        self.n, self.scaled, self.ignored = n, set(scaled), set(ignored)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        x, y = R.batch(i, n=1)
        x, y = x[0], y[0]
        return (x * 100.0 if i in self.scaled else x), (torch.tensor(-100) if i in self.ignored
                                                         else y)


class ManualAdam(L.LightningModule):
    """Manual optimization: ``training_step`` steps what ``self.optimizers()`` returns, a
    ``LightningOptimizer`` wrapping ``Adam(eps=0)``, and a ``FlightRecorder`` is attached to
    that wrapper when training starts (as one is for a GAN's discriminator, which the callback,
    following one optimizer, cannot record)."""

    def __init__(self, out_dir):
        super().__init__()
        self.net = R.make_mlp()
        self.automatic_optimization = False
        self.out_dir = out_dir
        self.recorder = None

    def on_train_start(self):
        from recorder import FlightRecorder

        self.recorder = FlightRecorder(self.net, self.optimizers(), out_dir=self.out_dir,
                                       guard_optimizer=True,
                                       factory="replay_models:make_mlp").attach()

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(torch.nn.functional.cross_entropy(self.net(x), y))
        opt.step()

    def configure_optimizers(self):
        return torch.optim.Adam(self.net.parameters(), lr=1e-2, eps=0.0)


def dead_feature_rows(n: int = 32) -> torch.utils.data.TensorDataset:
    """``replay_models.batch`` rows with feature 3 always 0: its weights' gradient is 0."""
    x, y = R.batch(0, n=n)
    x[:, 3] = 0.0
    return torch.utils.data.TensorDataset(x, y)
