"""Bugs a fuzz of the Hugging Face and Lightning Trainer callbacks found (train, bundle,
``nanreplay``), each a real ``Trainer`` run with the fault planted as a user would meet it."""

from __future__ import annotations

import pytest

L = pytest.importorskip("lightning")

import torch  # noqa: E402
import trainer_fuzz_found_models as T  # noqa: E402
from torch import nn  # noqa: E402

from recorder.lightning import FlightRecorderCallback  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("in_tests_dir"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated"),
]


class Lit(L.LightningModule):
    def __init__(self, lr: float):
        super().__init__()
        self.model, self.criterion, self.lr = T.make_net(), nn.CrossEntropyLoss(), lr

    def training_step(self, batch, i):
        x, y = batch
        return self.criterion(self.model(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=self.lr)


def _loader(n=16):
    g = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(torch.randn(n, T.D, generator=g),
                                        torch.randint(0, T.C, (n,), generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=4)


def _fit(tmp_path, lit, **kw):
    cb = FlightRecorderCallback(module="model", loss_fn="criterion", out_dir=tmp_path / "b",
                                factory="trainer_fuzz_found_models:make_net")
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, callbacks=[cb], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, **kw)
    trainer.fit(lit, _loader())
    return trainer, cb


def test_an_lr_beyond_float32_that_adam_refuses_is_named(tmp_path):
    """``lr=1e39`` with AdamW on CPU (its single-tensor update): torch raises "value cannot be
    converted to type float without overflow" inside ``step()``, no value is non-finite. The
    error now carries a note naming the setting and float32's largest value."""
    with pytest.raises(RuntimeError, match="without overflow") as info:
        _fit(tmp_path, Lit(lr=1e39))
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "AdamW.step() of step 0" in notes, notes
    assert "lr=1e+39 is beyond float32's largest finite value 3.4e+38" in notes, notes
    assert not list((tmp_path / "b").glob("*.nan"))  # nothing non-finite: no bundle
