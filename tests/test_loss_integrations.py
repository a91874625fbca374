"""Losses outside the model as the training frameworks compute them, and the integrations'
messages as users meet them.

A ``transformers.Trainer`` whose ``compute_loss`` override takes a masked mean over an
all-padding batch, a Lightning ``training_step`` returning ``F.mse_loss`` over a missing target:
the model re-runs finite, and ``nanreplay BUNDLE --json`` says the non-finite values entered
through the gradient of the model output, with the rows that carried it, reproduced, and a hint
in the integration's own terms. Also: the HF callback without ``accelerate``, the Lightning
warning for a submodule that ran on its own, the summary's parameter list.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from bundles import replay_report
from torch import nn

from recorder import FlightRecorder, NonFiniteError

HERE = Path(__file__).parent
K = 3
ENTERED = ("the gradient entering the model's output was non-finite; the model's backward made "
           "none of its own")
pytestmark = [
    pytest.mark.usefixtures("in_tests_dir"),
    pytest.mark.filterwarnings("ignore::UserWarning"),  # Lightning's advice on workers, logging
    pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated"),
]


# ---------------------------------------------------------------------------------------------
# Hugging Face Trainer: a compute_loss override


HF_BATCH = 4


def _hf_train(tmp_path, crit, **callback_options):
    """A Trainer whose ``compute_loss`` override calls ``crit(logits, labels)`` (the project's
    own loss); the batch of step K is all padding. Returns the NonFiniteError."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import hf_models as H

    from recorder.huggingface import FlightRecorderCallback

    class OwnLossTrainer(transformers.Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            out = model(**inputs)
            loss = crit(out.logits, labels)
            return (loss, out) if return_outputs else loss

    cb = FlightRecorderCallback(out_dir=tmp_path / "b", factory="hf_models:make_tiny_gpt2",
                                **callback_options)
    torch.manual_seed(0)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=HF_BATCH, max_steps=6,
        learning_rate=1e-3, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
        logging_strategy="no", seed=0)
    trainer = OwnLossTrainer(model=H.make_tiny_gpt2(), args=args, callbacks=[cb],
                             train_dataset=H.Tokens(padding=range(K * HF_BATCH,
                                                                  (K + 1) * HF_BATCH)))
    with pytest.raises(NonFiniteError) as info:
        trainer.train()
    assert trainer.state.global_step == K
    return info.value


def test_hf_compute_loss_override_over_a_padding_batch(tmp_path):
    """The override's masked mean is 0/0 over the padding batch and every gradient NaN; the
    callback sees no loss, so the event is a backward one."""
    import hf_models as H
    import user_losses as UL

    batch = HF_BATCH
    err = _hf_train(tmp_path, UL.ShiftedTokenCE())
    ev = err.event
    assert (ev["step"], ev["phase"]) == (K, "backward")  # the callback sees no loss
    rep, code = replay_report(err.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["detail"]) == ("loss", "<loss>", None, ENTERED)
    assert o["samples"] == list(range(batch))
    # every position but the last, which the shifted loss does not use
    assert o["positions"] == {"non_finite": batch * (H.CTX - 1) * H.VOCAB,
                              "of": batch * H.CTX * H.VOCAB}
    assert (rep["reproduced"], rep["cause"], code) == (True, None, 0)
    assert rep["fidelity"]["matches"] is True
    assert rep["problems"] == []
    assert "FlightRecorderCallback(loss_fn=...)" in rep["hint"] and "compute_loss" in rep["hint"]
    assert "hardware" not in rep["hint"] and "device" not in rep["hint"]


def test_hf_compute_loss_through_the_callbacks_loss_fn_is_replayed(tmp_path):
    """The hint's advice followed: the loss module given to the callback (``loss_fn=``) and
    called in compute_loss is checked (a loss event) and rebuilt from the bundle: op and line."""
    import user_losses as UL

    crit = UL.ShiftedTokenCE()
    err = _hf_train(tmp_path, crit, loss_fn=crit)
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (K, "loss", "<loss>")
    rep, code = replay_report(err.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["made"], o["samples"]) == (
        "loss", "<loss>", "aten.div", "nan", [])
    lines = (HERE / "user_losses.py").read_text().splitlines()
    assert o["source"] == "user_losses.py:" + str(
        next(i + 1 for i, t in enumerate(lines) if "# BUG shifted" in t))
    assert (rep["reproduced"], rep["cause"], code) == (True, "invalid", 0)
    assert rep["problems"] == []


def test_hf_callback_without_accelerate_says_so_in_one_line(monkeypatch):
    pytest.importorskip("transformers")
    from recorder.huggingface import FlightRecorderCallback

    monkeypatch.setitem(sys.modules, "accelerate", None)  # import accelerate now fails
    with pytest.raises(ImportError) as info:
        FlightRecorderCallback()
    msg = str(info.value)
    assert "\n" not in msg
    assert msg == ("FlightRecorderCallback: the Hugging Face Trainer integration needs the "
                   "'accelerate' package (transformers.Trainer runs its training loop through "
                   "it); install it: pip install accelerate")


# ---------------------------------------------------------------------------------------------
# Lightning: an inline loss in training_step


def _fit(module, callback, data, caplog=None):
    L = pytest.importorskip("lightning")
    torch.manual_seed(0)
    trainer = L.Trainer(accelerator="cpu", max_steps=6, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[callback])
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))
    return trainer


def test_lightning_inline_mse_over_a_missing_target(tmp_path):
    pytest.importorskip("lightning")
    import lightning_losses as LL

    from recorder.lightning import FlightRecorderCallback

    cb = FlightRecorderCallback(module="net", out_dir=tmp_path,
                                factory="replay_models:make_log_net")
    with pytest.raises(NonFiniteError) as info:
        _fit(LL.InlineMSE(), cb, LL.Targets(missing={K * 8 + 6}))
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"]) == (K, "loss", "<loss>")
    rep, code = replay_report(info.value.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["detail"], o["samples"]) == (
        "loss", "<loss>", None, ENTERED, [6])
    assert o["positions"] == {"non_finite": 1, "of": 8 * 3}  # sample 6's second output
    assert (rep["reproduced"], rep["cause"], code) == (True, None, 0)
    [note] = rep["problems"]
    assert note.startswith("the loss given to record_loss was computed outside")
    assert 'FlightRecorderCallback(loss_fn="criterion")' in rep["hint"]


def test_lightning_warning_names_the_callbacks_module_argument(tmp_path, caplog):
    pytest.importorskip("lightning")
    import lightning_models as LM

    from recorder.lightning import FlightRecorderCallback

    cb = FlightRecorderCallback(loss_fn="crit", out_dir=tmp_path)  # no module=: net runs alone
    with caplog.at_level("WARNING", logger="nanreplay"):
        _fit(LM.LogNetModule(), cb, LM.Rows())
    said = [r.getMessage() for r in caplog.records if r.name == "nanreplay"]
    assert len(said) == 1, said
    assert "while its submodule 'net.lin' ran on its own" in said[0]
    assert 'FlightRecorderCallback(module="model")' in said[0]
    assert "callback's module= argument" in said[0]


# ---------------------------------------------------------------------------------------------
# the recorder's summary


def test_summary_lists_parameter_names_with_a_count(tmp_path):
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(7)])  # 14 parameters
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=nn.MSELoss(), out_dir=tmp_path):
            for step in range(3):
                if step == 2:
                    with torch.no_grad():
                        for p in model.parameters():
                            p.fill_(float("nan"))  # a bad checkpoint load
                x = torch.randn(8, 4)
                opt.zero_grad()
                nn.functional.mse_loss(model(x), x).backward()
                opt.step()
    msg = str(info.value)
    assert "Parameters: 0.weight, 0.bias, 1.weight, 1.bias (+10 more)." in msg, msg
