"""``recorder.huggingface.FlightRecorderCallback`` in a real ``transformers.Trainer`` run.

A tiny GPT-2 (built from a config, nothing downloaded) trains with the Trainer's own optimizer,
scheduler and loop; the callback attaches the recorder when training begins and detaches it when
it ends. The planted bug is a batch of padding: every label ``-100``, so the model's own loss is
0 / 0 (transformers divides the summed loss by the number of labelled tokens).
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import hf_models as H  # noqa: E402
import torch  # noqa: E402

from recorder import NonFiniteError  # noqa: E402
from recorder.bundle import read_bundle  # noqa: E402
from recorder.huggingface import FlightRecorderCallback  # noqa: E402
from replay import replay  # noqa: E402

HERE = Path(__file__).parent
BATCH, K = 4, 3


pytestmark = pytest.mark.usefixtures("in_tests_dir")


class InOrder(transformers.Trainer):
    """Batches in dataset order, so the planted batch is step K's."""

    def _get_train_sampler(self, *args, **kwargs):
        return torch.utils.data.SequentialSampler(self.train_dataset)


def _trainer(tmp_path, dataset, callback, eval_dataset=None, **args):
    torch.manual_seed(0)
    defaults = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=BATCH,
                    max_steps=6, learning_rate=1e-3, report_to=[], save_strategy="no",
                    use_cpu=True, disable_tqdm=True, logging_strategy="no", seed=0)
    return InOrder(model=H.make_tiny_gpt2(), args=transformers.TrainingArguments(
        **{**defaults, **args}), train_dataset=dataset, eval_dataset=eval_dataset,
        callbacks=[callback])


@pytest.mark.parametrize("args", [{}, {"activation_checkpointing": True}],
                         ids=["plain", "activation_checkpointing"])
def test_padding_batch_is_caught_at_its_step_and_replayed(tmp_path, args):
    """With ``activation_checkpointing`` (gradient checkpointing) the blocks' modules run again inside backward (recorded
    as further calls): the event and the replay are the same."""
    cb = FlightRecorderCallback(out_dir=tmp_path / "b", factory="hf_models:make_tiny_gpt2")
    trainer = _trainer(tmp_path, H.Tokens(padding=range(K * BATCH, (K + 1) * BATCH)), cb,
                       **args)
    with pytest.raises(NonFiniteError) as info:
        trainer.train()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (K, "forward", "", "nan")
    assert ev["samples"] == []  # the model's 0-d loss names no row
    assert trainer.state.global_step == K  # the bad update never ran
    cb.detach()  # every hook left is the Trainer's own (checkpointing's input hook)
    assert all(getattr(h, "__qualname__", "").endswith("make_inputs_require_grads")
               for m in trainer.model.modules() for h in m._forward_hooks.values())
    assert not any(m._forward_hooks for m in trainer.model.modules()) or args
    rep = replay(info.value.bundle_path)
    assert rep["event"]["step"] == K
    assert rep["reproduced"] is True and rep["cause"] == "invalid"
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["made"]) == ("forward", "", "aten.div", "nan")
    from transformers.loss import loss_utils

    path, _, line = o["source"].rpartition(":")
    assert Path(path).resolve() == Path(inspect.getsourcefile(loss_utils)).resolve()
    assert "num_items_in_batch" in Path(path).read_text().splitlines()[int(line) - 1]


def test_clean_run_with_accumulation_and_evaluation(tmp_path):
    """No event; steps are the Trainer's optimizer steps (accumulated micro-batches and the
    evaluation loop between them do not add any); every hook goes when training ends."""
    cb = FlightRecorderCallback(out_dir=tmp_path / "b")
    trainer = _trainer(tmp_path, H.Tokens(), cb, eval_dataset=H.Tokens(n=8),
                       gradient_accumulation_steps=2, eval_strategy="steps", eval_steps=2,
                       per_device_eval_batch_size=BATCH)
    trainer.train()
    rec = cb.recorder
    assert trainer.state.global_step == 6 and rec.step == 6
    assert sum("eval_loss" in h for h in trainer.state.log_history) == 3
    assert rec.health.internal_errors == 0 and rec.event is None
    assert list((tmp_path / "b").glob("*.nan")) == []
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in trainer.model.modules())


def test_the_trainer_supplies_optimizer_and_schedule(tmp_path):
    with pytest.raises(TypeError, match="optimizer come"):
        FlightRecorderCallback(optimizer=None)
    with pytest.raises(ValueError, match="on_event must be"):
        FlightRecorderCallback(on_event="ignore")
    with pytest.raises(ValueError, match="stats must be 'minmax' or 'full'"):
        FlightRecorderCallback(stats="everything")
    with pytest.raises(ValueError, match="max_micro_batches must be an int >= 1, got 0"):
        FlightRecorderCallback(max_micro_batches=0)
    with pytest.raises(TypeError, match="^FlightRecorderCallback: unknown keyword argument.s. "
                                        "out_dri; did you mean out_dir=.$"):
        FlightRecorderCallback(out_dri=tmp_path)
    with pytest.raises(TypeError, match="unknown keyword argument.s. zzz; it takes allow_inf, "
                                        "allow_nan, factory"):
        FlightRecorderCallback(zzz=1)
    with pytest.raises(ValueError, match="factory 'nope:make' cannot be imported"):
        FlightRecorderCallback(out_dir=tmp_path, factory="nope:make")


def test_accelerate_wrappers_are_seen_through():
    """The Trainer hands callbacks accelerate's AcceleratedOptimizer, whose step calls the torch
    optimizer inside (where the hooks must go) and which holds fp16's GradScaler."""
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer

    from recorder.huggingface import _torch_optimizer

    Accelerator(cpu=True)
    opt = torch.optim.SGD(H.make_tiny_gpt2().parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    assert _torch_optimizer(AcceleratedOptimizer(opt, device_placement=False, scaler=scaler)) \
        == (opt, scaler)
    assert _torch_optimizer(opt) == (opt, None) and _torch_optimizer(None) == (None, None)


# dynamo reads .grad of a non-leaf frame input when guarding it, recorder or not; the warning
# it hides is an error under this suite's filterwarnings
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_trainer_side_compilation_is_one_compiled_region(tmp_path):
    """``TrainingArguments(torch_compile=True)``: the model is compiled inside the Trainer, where
    the callback cannot see the wrapper; it is recorded as one region (hooks that dynamo leaves
    out: no graph break), the event says compiled, and the replay finds the op eagerly."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    cb = FlightRecorderCallback(out_dir=tmp_path / "b", factory="hf_models:make_tiny_gpt2")
    trainer = _trainer(tmp_path, H.Tokens(padding=range(K * BATCH, (K + 1) * BATCH)), cb,
                       torch_compile=True, torch_compile_backend="aot_eager")
    try:
        with pytest.raises(NonFiniteError) as info:
            trainer.train()
        # transformers' own graph breaks (a logger call in the forward), none of the recorder's
        assert all("logging.Logger" in k for k in counters["graph_break"]), \
            dict(counters["graph_break"])
    finally:
        torch._dynamo.reset()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["compiled"]) == (K, "forward", "", True)
    assert trainer.state.global_step == K
    rep = replay(info.value.bundle_path)
    assert rep["event"]["step"] == K and rep["cause"] == "invalid"
    assert rep["reproduced"] is True and rep["origin"]["op"] == "aten.div"


def test_the_example_runs_end_to_end(tmp_path):
    """``python examples/hf_trainer.py``: the Trainer stops at the padding batch and the replay
    it runs names the op and the line in transformers' loss code (exit 0)."""
    import subprocess
    import sys

    script = HERE.parent / "examples" / "hf_trainer.py"
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "non-finite value (NaN) at step 3, phase forward" in proc.stdout
    assert "nan made by aten.div in <root>" in proc.stdout
    assert "loss_utils.py" in proc.stdout and "num_items_in_batch" in proc.stdout
    assert (tmp_path / "nan-bundles" / "step00000003-rank0.nan").exists()
    assert not (tmp_path / "hf-out").exists()


def test_a_resumed_run_keeps_its_step_numbers(tmp_path):
    """Train 3 steps with a checkpoint, resume to 6 with every batch padding: the first resumed
    step is global step 3, and so is the event and the bundle's name."""
    first = _trainer(tmp_path, H.Tokens(), FlightRecorderCallback(out_dir=tmp_path / "a"),
                     max_steps=3, save_strategy="steps", save_steps=3)
    first.train()
    cb = FlightRecorderCallback(out_dir=tmp_path / "b")
    resumed = _trainer(tmp_path, H.Tokens(padding=range(64)), cb)
    with pytest.raises(NonFiniteError) as info:
        resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-3"))
    assert info.value.event["step"] == 3
    assert info.value.bundle_path.name == "step00000003-rank0.nan"


def test_bf16_training_is_replayed_under_the_autocast_accelerate_wraps_the_forward_in(tmp_path):
    """``bf16=True``: accelerate wraps the model's ``forward`` in ``torch.autocast``, which the
    root's pre-hook (where a micro-batch's autocast is read) does not see yet. The bundle said
    no autocast, the replay ran float32, where ``1 - sigmoid(9.9)`` is 5e-5, not 0: 'NOT
    reproduced', blaming state outside the bundle."""
    bad = 2 * 8 + 4  # sample 4 of step 2
    cb = FlightRecorderCallback(out_dir=tmp_path / "b", factory="hf_models:make_clicker")
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, max_steps=6,
        learning_rate=1e-3, bf16=True, report_to=[], save_strategy="no", use_cpu=True,
        disable_tqdm=True, logging_strategy="no")
    trainer = InOrder(model=H.make_clicker(), args=args, train_dataset=H.Clicks(wrong_unit={bad}),
                      callbacks=[cb])
    with pytest.raises(NonFiniteError) as info:
        trainer.train()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"]) == (2, "forward", "")
    assert ev["kind"] == "+inf"  # the loss, -log(0)
    rep = replay(info.value.bundle_path)
    assert rep["reproduced"] is True and rep["cause"] == "precision"
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("", "aten.log", "-inf", [4])
    assert "bfloat16" in rep["hint"] and "binary_cross_entropy_with_logits" in rep["hint"]


def test_the_models_own_nan_check_raising_in_the_trainer_writes_the_bundle(tmp_path):
    """The Trainer calls no callback when training raises, so a model whose forward checks
    its loss (``raise ValueError("non-finite loss")``) ended ``train()`` with its own error
    and no bundle. The callback now sees the forward raise: the step is bundled as a ``check``
    event, the error goes on with the bundle's path as a note, and the replay names the op."""
    bad = 2 * 8 + 4  # sample 4 of step 2
    cb = FlightRecorderCallback(out_dir=tmp_path / "b", factory="hf_models:make_checked_clicker")
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, max_steps=6,
        learning_rate=1e-3, bf16=True, report_to=[], save_strategy="no", use_cpu=True,
        disable_tqdm=True, logging_strategy="no")
    trainer = InOrder(model=H.make_checked_clicker(), args=args, callbacks=[cb],
                      train_dataset=H.Clicks(wrong_unit={bad}))
    with pytest.raises(ValueError, match="non-finite loss") as info:
        trainer.train()
    notes = getattr(info.value, "__notes__", [])
    bundles = sorted((tmp_path / "b").glob("*.nan"))
    assert len(bundles) == 1 and any(str(bundles[0]) in n for n in notes), notes
    cb.detach()
    assert not any(m._forward_hooks for m in trainer.model.modules())
    rep = replay(bundles[0])
    meta = read_bundle(bundles[0], want=lambda name: False)[0]
    assert (meta["event"]["step"], meta["event"]["reason"]) == (2, "check"), meta["event"]
    o = rep["origin"]
    assert rep["reproduced"] is True and rep["cause"] == "precision", rep
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("", "aten.log", "-inf", [4])
