"""Lightning's learning-rate finder run inside a fit recorded by ``FlightRecorderCallback``.

The docs' ``LearningRateFinder`` subclass runs ``lr_find`` at chosen epochs, from
``on_train_epoch_start``: the recorder is attached by then. The finder swaps the Trainer's
callbacks for its own, raises the lr until the loss is no longer finite, then restores the
weights, optimizer and ``global_step``. Its divergence stopped the fit with a NonFiniteError,
and its steps put the recorder's numbering ahead of ``global_step``; the callback now pauses
the recorder while the finder runs.
"""

from __future__ import annotations

import math

import pytest

L = pytest.importorskip("lightning")

import torch  # noqa: E402
from lightning.pytorch.callbacks import LearningRateFinder  # noqa: E402
from torch import nn  # noqa: E402

from recorder import NonFiniteError  # noqa: E402
from recorder.lightning import FlightRecorderCallback  # noqa: E402
from replay import replay  # noqa: E402

BATCH, PER_EPOCH, ROW = 4, 8, 1
PLANT = (2, 3)  # (epoch, batch) of the bad record: after the finders of epochs 0 and 1
pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated"),
]


class Regressor(L.LightningModule):
    def __init__(self, plant: bool = False):
        super().__init__()
        self.lr, self.plant = 0.01, plant
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        self.crit = nn.MSELoss()

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.plant and (self.current_epoch, batch_idx) == PLANT:
            x = x.clone()
            x[ROW, 0] = float("nan")
        return self.crit(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class FineTuneLearningRateFinder(LearningRateFinder):
    """Lightning's documented recipe: find the lr again at given epochs."""

    def __init__(self, milestones, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.milestones = milestones
        self.diverged = []

    def on_fit_start(self, *args, **kwargs):
        return

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch in self.milestones:
            self.lr_find(trainer, pl_module)
            self.diverged.append(not all(map(math.isfinite,
                                             self.optimal_lr.results["loss"])))


class Losses(L.Callback):
    def __init__(self):
        self.values = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.values.append(outputs["loss"].item())


def _finder():
    return FineTuneLearningRateFinder((0, 1), min_lr=1e-2, max_lr=1e12, num_training_steps=6,
                                      early_stop_threshold=None)


def _fit(module, finder, *callbacks):
    torch.manual_seed(0)
    losses = Losses()
    trainer = L.Trainer(accelerator="cpu", max_steps=3 * PER_EPOCH, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=None,
                        callbacks=[finder, losses, *callbacks])
    g = torch.Generator().manual_seed(1)
    x = torch.randn(PER_EPOCH * BATCH, 4, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=BATCH))
    return trainer, losses.values


def test_lr_finder_inside_a_recorded_fit_is_paused_and_the_fit_unchanged(tmp_path,
                                                                        monkeypatch):
    monkeypatch.chdir(tmp_path)  # (the finder's checkpoint goes to the working directory)
    _, bare = _fit(Regressor(), _finder())
    cb = FlightRecorderCallback(module="net", loss_fn="crit", out_dir=tmp_path / "b")
    finder = _finder()
    trainer, recorded = _fit(Regressor(), finder, cb)
    assert finder.diverged == [True, True]  # each finder's loss went non-finite
    assert recorded == bare and len(bare) == 3 * PER_EPOCH  # bit-identical
    assert cb.recorder.step == trainer.global_step == 3 * PER_EPOCH
    assert cb.recorder.event is None and list(tmp_path.glob("b/*.nan")) == []


def test_a_bad_batch_after_the_lr_finder_is_an_event_at_its_global_step(tmp_path,
                                                                       monkeypatch):
    monkeypatch.chdir(tmp_path)
    cb = FlightRecorderCallback(module="net", loss_fn="crit", out_dir=tmp_path / "b")
    finder = _finder()
    with pytest.raises(NonFiniteError) as info:
        _fit(Regressor(plant=True), finder, cb)
    assert finder.diverged == [True, True]
    ev = info.value.event
    epoch, batch = PLANT
    assert (ev["step"], ev["phase"], ev["samples"]) == (epoch * PER_EPOCH + batch, "input",
                                                        [ROW])
    rep = replay(info.value.bundle_path)  # (the net: torch's own modules, rebuilt as is)
    assert rep["event"]["step"] == ev["step"] and rep["cause"] == "input"
