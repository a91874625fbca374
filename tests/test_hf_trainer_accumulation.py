"""The Hugging Face ``Trainer`` as fine-tuning scripts configure it — gradient accumulation
over 4 micro-batches, clipping, evaluation every few steps, a loss logged every step, bf16
autocast, Adafactor, a cosine schedule with warmup — on a model that computes its own loss
from ``labels=`` and returns a ``ModelOutput`` (``hf_trainer_accumulation_models``), under
``FlightRecorderCallback``. A step is an optimizer step (``trainer.state.global_step``), a
micro-batch one of its accumulated batches, and an evaluation forward is numbered by the
training step that follows it."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import hf_trainer_accumulation_models as M  # noqa: E402
import torch  # noqa: E402
from bundles import source_line  # noqa: E402

from recorder import NonFiniteError  # noqa: E402
from recorder.huggingface import FlightRecorderCallback  # noqa: E402
from replay import replay  # noqa: E402

pytestmark = pytest.mark.usefixtures("in_tests_dir")

B, ACC, EVAL_EVERY = 4, 4, 2  # micro-batch size, micro-batches per step, steps per evaluation


class InOrder(transformers.Trainer):
    """Batches in dataset order, so a planted row is a known step, micro-batch and sample."""

    def _get_train_sampler(self, *args, **kwargs):
        return torch.utils.data.SequentialSampler(self.train_dataset)


def train(tmp_path, data, eval_data, record=True, **kw):
    """A run of 4 steps; the trainer and the callback (None unless ``record``)."""
    args = transformers.TrainingArguments(**{**dict(
        output_dir=str(tmp_path / "o"), per_device_train_batch_size=B,
        per_device_eval_batch_size=B, gradient_accumulation_steps=ACC, max_grad_norm=1.0,
        max_steps=4, learning_rate=1e-2, eval_strategy="steps", eval_steps=EVAL_EVERY,
        logging_steps=1, save_strategy="no", use_cpu=True, report_to=[], disable_tqdm=True,
        seed=0, remove_unused_columns=False), **kw})
    cb = FlightRecorderCallback(out_dir=tmp_path / "b",
                                factory="hf_trainer_accumulation_models:make_scorer")
    t = InOrder(model=M.make_scorer(), args=args, train_dataset=data, eval_dataset=eval_data,
                callbacks=[cb] if record else [])
    return t, cb if record else None


def losses(t) -> list[tuple[str, float]]:
    return [(k, h[k]) for h in t.state.log_history for k in ("loss", "eval_loss") if k in h]


def test_bf16_adafactor_cosine_accumulated_run_is_unchanged_by_the_recorder(tmp_path):
    """Every logged training and evaluation loss bit for bit the same, no event, no bundle."""
    kw = dict(bf16=True, optim="adafactor", lr_scheduler_type="cosine", warmup_steps=2)
    plain, _ = train(tmp_path / "plain", M.Rows(64), M.Rows(8, seed=1), record=False, **kw)
    plain.train()
    t, cb = train(tmp_path, M.Rows(64), M.Rows(8, seed=1), **kw)
    t.train()
    assert len(losses(t)) == 4 + 4 // EVAL_EVERY and losses(t) == losses(plain)
    assert cb.recorder.event is None and cb.recorder.step == 4
    assert list((tmp_path / "b").glob("*.nan")) == []


def test_a_zero_record_in_the_second_micro_batch_is_named_at_its_step_and_row(tmp_path):
    """Step 1's micro-batch 1 holds an all-zero record at row 3, its labels sorted by chance
    (0, 0, 1, 1). Before, those labels, passed to the model as ``labels=``, read as a graph
    batch's assignment vector: the batch was taken as 2 graphs and row 3 named sample 1."""
    step, mb, row = 1, 1, 3
    first = (step * ACC + mb) * B
    t, cb = train(tmp_path, M.Rows(64, zero={first + row},
                                   labels={first + i: c for i, c in enumerate([0, 0, 1, 1])}),
                  M.Rows(8, seed=1))
    with pytest.raises(NonFiniteError) as info:
        t.train()
    ev = info.value.event
    assert t.state.global_step == step  # the bad update never ran
    assert (ev["step"], ev["phase"], ev["module"], ev["micro_batch"]) == (step, "forward", "", mb)
    assert ev["samples"] == [row]
    rep = replay(info.value.bundle_path)
    o = rep["origin"]
    assert rep["reproduced"] is True and rep["cause"] == "invalid"
    assert (o["phase"], o["module"], o["op"], o["micro_batch"], o["samples"]) == (
        "forward", "", "aten.div", mb, [row])
    assert o["source"].endswith(source_line("hf_trainer_accumulation_models.py",
                                            "x = x / x.norm(dim=-1, keepdim=True)"))


def test_a_zero_record_in_the_evaluation_set_is_an_evaluation_event(tmp_path):
    """Training data clean, the evaluation set's row 6 all zeros (its second batch, row 2,
    labels sorted 0, 0, 0, 1): the event comes at the first evaluation, after EVAL_EVERY
    steps, numbered by the training step that follows it. Before, row 2 was named sample 0
    (of 2 graphs the labels read as)."""
    bad = B + 2
    t, cb = train(tmp_path, M.Rows(64), M.Rows(8, seed=1, zero={bad}, labels={
        B + i: c for i, c in enumerate([0, 0, 0, 1])}))
    with pytest.raises(NonFiniteError) as info:
        t.train()
    ev = info.value.event
    assert t.state.global_step == EVAL_EVERY
    assert (ev["step"], ev["phase"], ev["module"], ev["evaluation"]) == (
        EVAL_EVERY, "forward", "", True)
    assert ev["samples"] == [bad % B]
    rep = replay(info.value.bundle_path)
    o = rep["origin"]
    assert rep["reproduced"] is True and rep["cause"] == "invalid"
    assert (o["phase"], o["module"], o["op"], o["samples"]) == (
        "forward", "", "aten.div", [bad % B])


def test_sorted_labels_beside_embedding_bag_offsets_leave_the_bags_named(tmp_path):
    """A NaN token weight of the last text, the batch's labels sorted (0, 0, 1, 1) and given
    to the model: before, the labels read as a graph batch's assignment vector, which hid the
    bags' offsets, and no sample was named."""
    from recorder import FlightRecorder

    model = M.make_bag_classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    offsets = torch.tensor([0, 3, 5, 9])
    weights = torch.ones(12)
    weights[10] = float("nan")  # a token of the text from offsets[3] on
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, out_dir=tmp_path,
                            factory="hf_trainer_accumulation_models:make_bag_classifier"):
            out = model(torch.randint(0, 20, (12,)), offsets, per_sample_weights=weights,
                        labels=torch.tensor([0, 0, 1, 1]))
            out["loss"].backward()
            opt.step()
    ev = info.value.event
    assert (ev["phase"], ev["tensor"], ev["samples"]) == (
        "input", 'kwargs["per_sample_weights"]', [3])
    assert replay(info.value.bundle_path)["origin"]["samples"] == [3]
