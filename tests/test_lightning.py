"""``recorder.lightning.FlightRecorderCallback`` in real ``lightning.Trainer.fit`` runs.

Lightning calls the ``training_step`` (not the module's forward) inside
``optimizer.step(closure)``; the callback records the submodule the step calls and the recorder
checks each step when the closure returns, before the update.
"""

from __future__ import annotations

import json
import math

import pytest

L = pytest.importorskip("lightning")

import lightning_losses as LL  # noqa: E402
import lightning_models as LM  # noqa: E402
import torch  # noqa: E402
from bundles import invoke_cli  # noqa: E402
from torch import nn  # noqa: E402

from recorder import NonFiniteError  # noqa: E402
from recorder.bundle import read_bundle  # noqa: E402
from recorder.lightning import FlightRecorderCallback  # noqa: E402
from replay import replay  # noqa: E402

K, BATCH = 3, 8
pytestmark = [
    pytest.mark.usefixtures("in_tests_dir"),
    # Lightning's own advice (worker counts, logging intervals) and its pytree shim's
    # deprecation notice: not this project's to act on
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated"),
]


def _fit(module, callback, train, val=None, ckpt_path=None, **trainer_args):
    torch.manual_seed(0)
    trainer = L.Trainer(**{"accelerator": "cpu", "max_steps": 6, "logger": False,
                           "enable_checkpointing": False, "enable_progress_bar": False,
                           "enable_model_summary": False, "callbacks": [callback],
                           **trainer_args})
    loader = torch.utils.data.DataLoader(train, batch_size=BATCH)
    val_loader = torch.utils.data.DataLoader(val, batch_size=BATCH) if val is not None else None
    trainer.fit(module, loader, val_loader, ckpt_path=ckpt_path)
    return trainer


def test_nan_in_a_submodule_is_caught_before_its_update_and_replayed(tmp_path):
    module = LM.LogNetModule()
    cb = FlightRecorderCallback(module="net", loss_fn="crit", out_dir=tmp_path,
                                factory="replay_models:make_log_net")
    before = {}

    class Snap(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            before[batch_idx] = {n: p.detach().clone() for n, p in pl_module.named_parameters()}

    with pytest.raises(NonFiniteError) as info:
        torch.manual_seed(0)
        trainer = L.Trainer(accelerator="cpu", max_steps=6, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, callbacks=[cb, Snap()])
        trainer.fit(module, torch.utils.data.DataLoader(LM.Rows(scaled={K * BATCH + 5}),
                                                        batch_size=BATCH))
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (K, "forward", "act", [5])
    assert trainer.global_step == K  # the update of step K never ran:
    assert all(torch.equal(p, before[K][n]) for n, p in module.named_parameters())
    assert not any(m._forward_hooks for m in module.modules())  # detached on the exception
    rep = replay(info.value.bundle_path)
    assert rep["event"]["step"] == K
    assert rep["reproduced"] is True and rep["cause"] == "invalid"
    o = rep["origin"]
    assert (o["module"], o["call"], o["op"], o["samples"]) == ("act", 0, "aten.log", [5])


def test_a_loss_module_trained_with_the_network_is_recorded_with_it(tmp_path):
    """``configure_optimizers`` over ``self.parameters()`` trains the loss module's learned
    temperature too: the callback's recorder refused to attach ('move them into the model').
    It records it as ``<loss>.log_scale``, and the replay reproduces the step."""
    cb = FlightRecorderCallback(module="net", loss_fn="crit", out_dir=tmp_path,
                                factory="replay_models:make_log_net")
    with pytest.raises(NonFiniteError) as info:
        _fit(LM.LearnedTemperature(), cb, LM.Rows(scaled={K * BATCH + 5}))
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (K, "forward", "act", [5])
    meta, _ = read_bundle(info.value.bundle_path)
    assert meta["params"][-1] == "<loss>.log_scale"
    rep = replay(info.value.bundle_path)
    assert rep["reproduced"] is True and rep["cause"] == "invalid"
    assert (rep["origin"]["module"], rep["origin"]["op"]) == ("act", "aten.log")


def test_clean_fit_with_validation_and_accumulation(tmp_path):
    """Steps are Lightning's optimizer steps: micro-batches before the closure belong to the
    step, the validation loop and the sanity check are evaluation forwards."""
    module = LM.LogNetModule()
    cb = FlightRecorderCallback(module="net", loss_fn="crit", out_dir=tmp_path)
    trainer = _fit(module, cb, LM.Rows(n=128), LM.Rows(n=16), accumulate_grad_batches=2,
                   val_check_interval=4, limit_val_batches=2)
    rec = cb.recorder
    assert trainer.global_step == 6 and rec.step == 6
    assert rec.event is None and rec.health.internal_errors == 0
    assert list(tmp_path.glob("*.nan")) == []
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())


def test_lightning_module_itself_is_recorded_when_its_forward_runs_the_step(tmp_path):
    cb = FlightRecorderCallback(loss_fn="crit", out_dir=tmp_path)
    with pytest.raises(NonFiniteError) as info:
        _fit(LM.Forwarding(), cb, LM.Rows(scaled={K * BATCH + 2}))
    ev = info.value.event
    assert (ev["step"], ev["module"], ev["samples"]) == (K, "net.act", [2])


def test_an_inline_loss_is_checked_through_lightning(tmp_path):
    """A training_step computing ``F.cross_entropy`` inline, whose batch at step K has every
    target ignored: the mean over no targets is 0/0 = NaN while every gradient is 0, so only the
    loss shows it. The callback hands the loss to ``record_loss``: a loss event at step K
    before the update, and the replay re-runs the model (finite) and says the loss is not in
    the bundle instead of guessing."""
    module = LM.InlineLoss()
    cb = FlightRecorderCallback(module="net", out_dir=tmp_path,
                                factory="replay_models:make_log_net")
    with pytest.raises(NonFiniteError) as info:
        trainer = L.Trainer(accelerator="cpu", max_steps=6, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, callbacks=[cb])
        trainer.fit(module, torch.utils.data.DataLoader(
            LM.Rows(ignored=range(K * BATCH, (K + 1) * BATCH)), batch_size=BATCH))
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (K, "loss", "<loss>", "nan")
    assert trainer.global_step == K
    rep = replay(info.value.bundle_path)
    assert rep["event"]["step"] == K
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], rep["cause"]) == ("loss", "<loss>", None, None)
    assert rep["reproduced"] is False
    assert any("record_loss" in p for p in rep["problems"]), rep["problems"]
    assert "loss_fn=" in rep["hint"]
    _, tensors = read_bundle(info.value.bundle_path)  # the loss history the report plots
    losses = tensors["ring/loss"].tolist()
    assert len(losses) == K + 1 and all(0 < v < 10 for v in losses[:K]), losses
    assert math.isnan(losses[K])
    # the same fit with the targets intact: every step's loss checked, no event
    cb = FlightRecorderCallback(module="net", out_dir=tmp_path / "clean")
    _fit(LM.InlineLoss(), cb, LM.Rows())
    assert cb.recorder.event is None and cb.recorder.health.internal_errors == 0


def test_a_training_step_raising_on_its_nan_still_gets_the_bundle(tmp_path):
    """The training_step's own guard raises before backward: Lightning reports the exception to
    the callback, which checks the cut-short step, writes the bundle and notes it on the
    exception that fit() raises."""
    cb = FlightRecorderCallback(module="net", loss_fn="crit", out_dir=tmp_path,
                                factory="replay_models:make_log_net")
    with pytest.raises(ValueError, match=f"non-finite loss at batch {K}") as info:
        _fit(LM.Guarded(), cb, LM.Rows(scaled={K * BATCH + 5}))
    ev = cb.recorder.event
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (K, "forward", "act", [5])
    [bundle] = tmp_path.glob("*.nan")
    if hasattr(info.value, "add_note"):  # Python 3.11+
        assert any(str(bundle) in n for n in info.value.__notes__)
    rep = replay(bundle)
    assert rep["event"]["step"] == K
    assert rep["reproduced"] is True and rep["cause"] == "invalid"
    assert (rep["origin"]["module"], rep["origin"]["op"]) == ("act", "aten.log")
    assert rep["origin"]["samples"] == [5]


def test_what_the_callback_cannot_follow_is_said(tmp_path):
    with pytest.raises(TypeError, match="optimizer, start_step come"):
        FlightRecorderCallback(optimizer=None, start_step=3)
    cb = FlightRecorderCallback(module="model", out_dir=tmp_path)
    with pytest.raises(AttributeError, match="module='model': LogNetModule has no attribute"):
        _fit(LM.LogNetModule(), cb, LM.Rows())
    cb = FlightRecorderCallback(out_dir=tmp_path)
    with pytest.raises(RuntimeError, match="has 2 optimizers; the recorder follows one"):
        _fit(LM.LogNetModule(optimizers=2), cb, LM.Rows())


def test_compiled_lightning_module_is_one_region(tmp_path):
    """``trainer.fit(torch.compile(module))``: Lightning compiles the module's forward and
    training_step in place; the module is one compiled region, its hooks run outside the graphs
    (only the calls dynamo must skip for them split the training_step), the event says so, and
    the replay finds the op inside it eagerly."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    cb = FlightRecorderCallback(loss_fn="crit", out_dir=tmp_path,
                                factory="lightning_models:make_forwarding")
    try:
        with pytest.raises(NonFiniteError) as info:
            _fit(torch.compile(LM.Forwarding(), backend="aot_eager"), cb,
                 LM.Rows(scaled={K * BATCH + 2}))
        breaks = list(counters["graph_break"])
    finally:
        torch._dynamo.reset()
    assert all("torch.compiler.disable" in b for b in breaks), breaks
    ev = info.value.event
    assert (ev["step"], ev["module"], ev["compiled"], ev["samples"]) == (K, "", True, [2])
    rep = replay(info.value.bundle_path)
    assert rep["event"]["step"] == K
    assert rep["reproduced"] is True and rep["cause"] == "invalid"
    assert (rep["origin"]["module"], rep["origin"]["op"]) == ("net.act", "aten.log")
    assert rep["origin"]["samples"] == [2]


def test_a_resumed_fit_keeps_its_step_numbers(tmp_path):
    """Fit 3 steps and checkpoint; resume to 6 from the checkpoint with every sample scaled up:
    the first resumed step is global step 3, and so is the event and the bundle's name (the
    recorder attaches after Lightning restored the step)."""
    module = LM.LogNetModule()
    ckpt = tmp_path / "three.ckpt"
    trainer = _fit(module, FlightRecorderCallback(module="net", out_dir=tmp_path / "a"),
                   LM.Rows(), max_steps=3)
    trainer.save_checkpoint(ckpt)
    cb = FlightRecorderCallback(module="net", out_dir=tmp_path / "b")
    with pytest.raises(NonFiniteError) as info:
        _fit(LM.LogNetModule(), cb, LM.Rows(scaled=range(64)), ckpt_path=str(ckpt))
    ev = info.value.event
    assert (ev["step"], ev["module"]) == (3, "act")
    assert info.value.bundle_path.name == "step00000003-rank0.nan"


def test_sanity_check_validation_is_watched(tmp_path):
    """Lightning's sanity check runs validation batches before training starts: a NaN there is
    an evaluation event before step 0, raised before any training step ran."""
    cb = FlightRecorderCallback(module="net", loss_fn="crit", out_dir=tmp_path)
    with pytest.raises(NonFiniteError) as info:
        _fit(LM.LogNetModule(), cb, LM.Rows(), LM.Rows(n=16, scaled={9}),
             num_sanity_val_steps=2)
    ev = info.value.event
    assert (ev["step"], ev["module"], ev["evaluation"], ev["samples"]) == (0, "act", True, [1])


def test_a_recorder_given_self_optimizers_records_the_optimizer_inside(tmp_path):
    """``FlightRecorder(net, self.optimizers())`` under manual optimization: the recorder hooks
    and records the Adam inside Lightning's wrapper (``LightningAdam``, which no replay can
    rebuild), so the update Adam(eps=0) breaks is re-run: cause optimizer, reproduced."""
    module = LM.ManualAdam(tmp_path)
    torch.manual_seed(0)
    trainer = L.Trainer(accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(NonFiniteError) as info:
        trainer.fit(module, torch.utils.data.DataLoader(LM.dead_feature_rows(), batch_size=BATCH))
    module.recorder.detach()
    assert module.recorder.target.optimizer() is module.optimizers().optimizer
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["params"][0]) == (0, "optimizer", "0.weight")
    meta, _ = read_bundle(info.value.bundle_path)
    assert meta["optimizer"]["class"] == "torch.optim.adam.Adam"
    rep = replay(info.value.bundle_path)
    assert rep["reproduced"] is True and rep["cause"] == "optimizer", rep["problems"]
    assert (rep["origin"]["op"], rep["origin"]["params"][0]) == ("aten.addcdiv_", "0.weight")
    assert "eps=0" in rep["hint"], rep["hint"]


@pytest.mark.parametrize("rewind", [None, 2])
def test_an_lr_try_is_re_run_only_when_an_update_before_the_event_is(tmp_path, rewind):
    """Adam at lr=0.5 drives a click tower's logits out of sigmoid's range in one update, and
    the hand-written BCE takes log(0) at step 1, before step 1's update. Without a window the
    re-run holds no update before the event: ``--try lr=`` cannot change it, and said 'nan at
    step 1', as if a smaller rate would not have helped. With ``rewind`` the update of step 0
    is re-run with the smaller rate, and the step stays finite."""
    cb = FlightRecorderCallback(module="model", loss_fn="criterion", out_dir=tmp_path,
                                factory="lightning_losses:make_tower", rewind=rewind)
    with pytest.raises(NonFiniteError) as info:
        _fit(LL.ClickTower(lr=0.5), cb, LL.clicks(), precision="bf16-mixed",
             accumulate_grad_batches=2, gradient_clip_val=1.0)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"]) == (1, "loss", "<loss>")
    res = invoke_cli(info.value.bundle_path, "--json", "--try", "lr=0.01", "--try",
                     "dtype=float64")
    rep = json.loads(res.stdout)
    assert (rep["cause"], rep["origin"]["op"], rep["origin"]["module"]) == \
        ("underflow", "aten.log", "<loss>")
    tries = {t["try"]: t for t in rep["what_if"]}
    assert tries["dtype=float64"]["finite"] is True  # still re-run: float64 holds the value
    if rewind:
        assert tries["lr=0.01"]["finite"] is True
        return
    assert tries["lr=0.01"] == {
        "try": "lr=0.01", "finite": None, "inconclusive": None, "event_step": None,
        "origin": None,
        "note": "lr changes the optimizer's updates, and the re-run has none before the event "
                "(it happens before step 1's update): record with FlightRecorder(..., "
                "rewind=N) to re-run the updates that led to it"}


def test_lazy_modules_under_automatic_optimization_keep_the_trainer_s_step_numbers(tmp_path):
    """A LightningModule of lazy modules: Lightning's automatic optimization runs each forward
    inside ``optimizer.step(closure)``, so the recorder, waiting for their shapes
    (``recorder.lazy_init``), attaches inside step 1 and records from step 2; the NaN of
    batch 4, row 5, is step 4's input event (it was step 3's: step 1 merged into step 2)."""
    class LazyRegressor(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.LazyLinear(16), nn.ReLU(), nn.LazyLinear(1))

        def forward(self, x):
            return self.net(x).squeeze(1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(6 * BATCH, 5, generator=g), torch.randn(6 * BATCH, generator=g)
    x[4 * BATCH + 5, 2] = float("nan")
    with pytest.raises(NonFiniteError) as info:
        _fit(LazyRegressor(), FlightRecorderCallback(out_dir=tmp_path),
             torch.utils.data.TensorDataset(x, y))
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["samples"]) == (4, "input", [5]), ev
