"""``FlightRecorderCallback`` under the Trainer's training features: gradient accumulation with
clipping, validation mid-epoch and every n epochs after a sanity check, bf16-mixed on CPU,
callbacks that touch the weights or the schedule (``StochasticWeightAveraging``, a hand-written
EMA swapped in for validation, ``LearningRateMonitor``, ``ModelCheckpoint`` every n steps), a
per-step scheduler, a fit resumed from a checkpoint with ``ckpt_path=``, and a GAN whose
discriminator a ``FlightRecorder`` watches."""

from __future__ import annotations

import pytest

L = pytest.importorskip("lightning")

import lightning_manual_models as M  # noqa: E402
import lightning_models as LM  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import (  # noqa: E402
    LearningRateMonitor,
    ModelCheckpoint,
    StochasticWeightAveraging,
)

from recorder import NonFiniteError  # noqa: E402
from recorder.bundle import read_bundle  # noqa: E402
from recorder.lightning import FlightRecorderCallback  # noqa: E402
from replay import replay  # noqa: E402

B = 8
pytestmark = [
    pytest.mark.usefixtures("in_tests_dir"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated"),
]


def recorder_cb(out):
    return FlightRecorderCallback(module="net", loss_fn="crit", out_dir=out,
                                  factory="replay_models:make_log_net")


def fit(module, callbacks, train, val=None, ckpt_path=None, **trainer_args):
    torch.manual_seed(0)
    trainer = L.Trainer(**{"accelerator": "cpu", "max_steps": 6, "logger": False,
                           "enable_checkpointing": False, "enable_progress_bar": False,
                           "enable_model_summary": False, "callbacks": callbacks,
                           **trainer_args})
    val = torch.utils.data.DataLoader(val, batch_size=B) if val is not None else None
    trainer.fit(module, torch.utils.data.DataLoader(train, batch_size=B), val,
                ckpt_path=ckpt_path)
    return trainer


class StepScheduled(LM.LogNetModule):
    """``configure_optimizers`` returning the optimizer and a per-step scheduler, kept as an
    attribute (as modules often keep it)."""

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.05)
        self.sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": self.sched, "interval": "step"}}


class SwappedEMA(L.Callback):
    """A hand-written EMA: averaged after each batch, copied into the module for validation
    and the trained weights put back after it (weights written outside the optimizer)."""

    def on_train_start(self, trainer, pl_module):
        self.ema = {n: p.detach().clone() for n, p in pl_module.named_parameters()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        for n, p in pl_module.named_parameters():
            self.ema[n].lerp_(p.detach(), 0.1)

    def on_validation_start(self, trainer, pl_module):
        if hasattr(self, "ema"):  # (not in the sanity check)
            self.kept = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
            self._load(pl_module, self.ema)

    def on_validation_end(self, trainer, pl_module):
        if hasattr(self, "kept"):
            self._load(pl_module, self.kept)
            del self.kept

    @staticmethod
    def _load(pl_module, values):
        with torch.no_grad():
            for n, p in pl_module.named_parameters():
                p.copy_(values[n])


def test_an_accumulated_clipped_step_names_its_micro_batch(tmp_path):
    """Four micro-batches per optimizer step, clipped by norm: the row scaled up in micro-batch
    2 of step 1 is that step's event (steps are optimizer steps), before its update."""
    step, micro, row = 1, 2, 5
    cb = recorder_cb(tmp_path)
    with pytest.raises(NonFiniteError) as info:
        fit(LM.LogNetModule(), [cb], LM.Rows(n=128, scaled={(step * 4 + micro) * B + row}),
            max_steps=3, accumulate_grad_batches=4, gradient_clip_val=1.0,
            gradient_clip_algorithm="norm")
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["micro_batch"], ev["module"], ev["samples"]) == \
        (step, "forward", micro, "act", [row])
    rep = replay(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["event"]["step"], rep["reproduced"], rep["cause"]) == (step, True, "invalid")
    assert (o["module"], o["op"], o["micro_batch"], o["samples"]) == \
        ("act", "aten.log", micro, [row])


def test_a_nan_only_in_validation_every_n_epochs_is_an_evaluation_event(tmp_path):
    """Two batches an epoch, validation after every second epoch, a sanity check before: the
    validation row scaled up is found when validation first runs (the step training reached
    then), as an evaluation forward; the sanity check, which never reaches that batch, trips
    nothing."""
    at = {}

    class ValidationStep(L.Callback):
        def on_validation_start(self, trainer, pl_module):
            at.setdefault("sanity" if trainer.sanity_checking else "first", trainer.global_step)

    cb = recorder_cb(tmp_path)
    with pytest.raises(NonFiniteError) as info:
        fit(LM.LogNetModule(), [ValidationStep(), cb], LM.Rows(n=16),
            LM.Rows(n=16, scaled={B + 3}), max_steps=-1, max_epochs=4,
            check_val_every_n_epoch=2, num_sanity_val_steps=1)
    ev = info.value.event
    assert at == {"sanity": 0, "first": 4}
    assert (ev["step"], ev["evaluation"], ev["module"], ev["samples"]) == \
        (at["first"], True, "act", [3])
    rep = replay(info.value.bundle_path)
    assert (rep["reproduced"], rep["cause"], rep["origin"]["op"]) == (True, "invalid", "aten.log")


def _fit_with_everything(out, record: bool, ckpt_path=None, max_steps=8):
    callbacks = [StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=2), SwappedEMA(),
                 LearningRateMonitor("step"),
                 ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=2, save_top_k=-1)]
    cb = recorder_cb(out / "nan")
    torch.manual_seed(0)
    module = StepScheduled()
    trainer = fit(module, callbacks + ([cb] if record else []), LM.Rows(n=32), LM.Rows(n=16),
                  ckpt_path=ckpt_path, max_steps=max_steps, precision="bf16-mixed",
                  accumulate_grad_batches=2, gradient_clip_val=1.0, val_check_interval=2,
                  num_sanity_val_steps=2, enable_checkpointing=True,
                  logger=L.pytorch.loggers.CSVLogger(out / "logs"))
    if record:
        assert cb.recorder.step == trainer.global_step == max_steps
        assert cb.recorder.event is None and cb.recorder.health.internal_errors == 0
    return [p.detach().clone() for p in module.parameters()]


def test_a_healthy_fit_with_weight_touching_callbacks_trains_bit_identically(tmp_path):
    """SWA (its SWALR swapped in at epoch 1), an EMA copied in for each validation, a learning
    rate monitor, checkpoints every 2 steps, a per-step scheduler, bf16-mixed, accumulation,
    clipping and a sanity check: the same weights with the recorder and without, no event,
    its step the Trainer's; the fit resumed from a checkpoint too."""
    plain = _fit_with_everything(tmp_path / "plain", record=False)
    recorded = _fit_with_everything(tmp_path / "rec", record=True)
    assert all(torch.equal(a, b) for a, b in zip(plain, recorded))
    [ckpt] = (tmp_path / "rec" / "ckpt").glob("*-step=4.ckpt")  # (saved with the recorder)
    plain = _fit_with_everything(tmp_path / "plain", False, ckpt_path=ckpt, max_steps=10)
    recorded = _fit_with_everything(tmp_path / "rec", True, ckpt_path=ckpt, max_steps=10)
    assert all(torch.equal(a, b) for a, b in zip(plain, recorded))
    assert not list(tmp_path.rglob("*.nan"))


def test_a_nan_swa_rate_is_named_with_the_scheduler_swa_swapped_in(tmp_path):
    """``StochasticWeightAveraging(swa_lrs=nan)`` (an LR finder's suggestion from losses that
    went NaN) replaces the module's StepLR with an SWALR when its epoch starts: the first
    update writes NaN. The bundle described the StepLR the module still held, and the hint
    said StepLR derives every rate from the NaN settings; it names the SWALR that ran."""
    cb = recorder_cb(tmp_path)
    with pytest.raises(NonFiniteError) as info:
        fit(StepScheduled(), [StochasticWeightAveraging(swa_lrs=float("nan"),
                                                        swa_epoch_start=1), cb], LM.Rows(n=32))
    ev = info.value.event
    assert (ev["step"], ev["phase"]) == (0, "optimizer")
    meta, _ = read_bundle(info.value.bundle_path)
    assert meta["lr_scheduler"]["class"] == "torch.optim.swa_utils.SWALR"
    rep = replay(info.value.bundle_path)
    assert rep["cause"] == "optimizer"
    assert "swa_lr=nan" in rep["hint"] and "the settings SWALR derives" in rep["hint"], \
        rep["hint"]


def test_a_nan_real_image_in_the_watched_discriminators_step(tmp_path):
    """Two optimizers under manual optimization, the discriminator recorded: real image 20 (the
    third batch, row 4 of the discriminator's batch of real and fake rows) holds NaN. The
    generator's loss of batch b - 1 opens the discriminator's step b as its micro-batch 0, so
    the discriminator's own forward of batch b is micro-batch 1 of its step b."""
    batch, row = divmod(20, M.B)
    data = M.real_images()
    data.tensors[0][20, 3] = float("nan")
    torch.manual_seed(0)
    module = M.GAN(tmp_path, watch="disc")
    torch.manual_seed(0)
    trainer = L.Trainer(accelerator="cpu", max_steps=40, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
    with pytest.raises(NonFiniteError) as info:
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=M.B))
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["micro_batch"], ev["samples"]) == \
        (batch, "input", 1, [row])
    assert trainer.global_step == 2 * batch  # both networks' updates of the earlier batches
    rep = replay(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["micro_batch"], o["samples"]) == \
        (True, "input", 1, [row])
