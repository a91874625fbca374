"""End to end: Hugging Face ``transformers`` training as its users write it
(``hf_trainer_stack_models``: tiny ``BertForSequenceClassification``, a mean-pooled head and a
SimCSE encoder on ``AutoModel``, built from configs), run by a real ``Trainer`` — subclassed
with ``compute_loss`` overrides (a class-weighted cross-entropy, a distillation KL against a
frozen teacher, InfoNCE, a triplet loss), ``DataCollatorWithPadding`` with attention masks and
``-100`` labels, gradient accumulation, clipping, warmup and a linear schedule, bf16 autocast —
under ``FlightRecorderCallback`` until a planted bug of the domain fires, then replayed with
the CLI. Step numbers are checked against ``trainer.state.global_step``, module and parameter
names against the HF model's."""

from __future__ import annotations

from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import hf_trainer_stack_models as M  # noqa: E402
import torch  # noqa: E402
from bundles import nanreplay_json, source_line  # noqa: E402

from recorder import NonFiniteError  # noqa: E402
from recorder.huggingface import FlightRecorderCallback  # noqa: E402

pytestmark = pytest.mark.usefixtures("in_tests_dir")

B, K = 4, 2  # batch size; the step a planted batch is


def line_of(text: str) -> str:
    return source_line("hf_trainer_stack_models.py", text)


def trainer(tmp_path, cls, model, data, collator, factory=None, loss=None, record=True,
            **kw):
    """``cls`` over ``data`` with the recorder's callback (``factory`` names ``model``'s)."""
    args = dict(output_dir=str(tmp_path / "o"), per_device_train_batch_size=B, max_steps=K + 1,
                learning_rate=1e-3, report_to=[], save_strategy="no", use_cpu=True,
                disable_tqdm=True, logging_strategy="no", seed=0, remove_unused_columns=False)
    cb = FlightRecorderCallback(out_dir=tmp_path / "b", loss_fn=loss,
                                factory=f"hf_trainer_stack_models:{factory}") if record else None
    extra = {"loss_fn": loss} if loss is not None else {}
    t = cls(model=model, args=transformers.TrainingArguments(**{**args, **kw}),
            train_dataset=data, data_collator=collator, callbacks=[cb] if cb else [], **extra)
    return t, cb


def fire(t):
    """Train until the event; the bundle's JSON report and the event."""
    with pytest.raises(NonFiniteError) as info:
        t.train()
    return nanreplay_json(info.value.bundle_path, "--json", code=None), info.value.event


def origin(rep):
    o = rep["origin"]
    return o["phase"], o["module"], o["op"], rep["event"]["step"], rep["cause"]


def test_healthy_run_raises_nothing_and_trains_identically(tmp_path):
    """Class-weighted loss, gradient accumulation, clipping, warmup, a linear schedule, bf16:
    no event, and the same weights bit for bit with and without the recorder."""
    weights = []
    for record in (False, True):
        t, cb = trainer(tmp_path / str(record), M.trainer_classes()["weighted"],
                        M.make_pooled(), M.sentences(48), M.with_padding(), "make_pooled",
                        loss=M.WeightedCE(), record=record, max_steps=4,
                        gradient_accumulation_steps=2, max_grad_norm=1.0, warmup_steps=2,
                        lr_scheduler_type="linear", bf16=True)
        t.train()
        weights.append({k: v.clone() for k, v in t.model.state_dict().items()})
        if record:
            assert cb.recorder.event is None and cb.recorder.step == 4
            assert t.state.global_step == 4
            assert list((tmp_path / str(record) / "b").glob("*.nan")) == []
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_an_empty_text_in_the_second_micro_batch_is_named_in_the_mean_pooling(tmp_path):
    """A text whose tokenization is empty: the collator pads it whole (attention mask all 0)
    and the head's masked mean is 0/0 on that row, in the step's second micro-batch."""
    empty = 2 * K * B + B + 1  # micro-batch 1, row 1 of step K
    t, cb = trainer(tmp_path, M.trainer_classes()["weighted"], M.make_pooled(),
                    M.sentences(48, empty={empty}), M.with_padding(), "make_pooled",
                    loss=M.WeightedCE(), gradient_accumulation_steps=2)
    rep, ev = fire(t)
    assert t.state.global_step == K and ev["step"] == K
    assert origin(rep) == ("forward", "", "aten.div", K, "invalid")
    assert rep["origin"]["samples"] == [1] and rep["origin"]["micro_batch"] == 1
    assert rep["origin"]["source"] == line_of("pooled = (h * m).sum(1) / m.sum(1)")
    assert 'kwargs["attention_mask"]' in rep["hint"] and "empty records" in rep["hint"]


def test_a_micro_batch_with_every_label_minus_100_is_named_in_the_weighted_loss(tmp_path):
    """Every row of one accumulated micro-batch labelled -100: the weighted cross-entropy's
    mean divides by a total weight of 0."""
    skipped = range(2 * K * B + B, 2 * K * B + 2 * B)
    t, _ = trainer(tmp_path, M.trainer_classes()["weighted"], M.make_bert_cls(),
                   M.unlabelled(M.sentences(48), skipped), M.with_padding(), "make_bert_cls",
                   loss=M.WeightedCE(), gradient_accumulation_steps=2)
    rep, ev = fire(t)
    assert t.state.global_step == K and (ev["phase"], ev["module"]) == ("loss", "<loss>")
    assert origin(rep) == ("loss", "<loss>", "aten.nll_loss_forward", K, "invalid")
    assert rep["origin"]["micro_batch"] == 1
    assert rep["origin"]["source"] == line_of("return F.cross_entropy(logits.float()")
    assert "ignore_index (-100)" in rep["hint"] and "micro-batch 1 (of 2" in rep["hint"]


def test_a_corrupted_embedding_row_is_named_by_its_token_id(tmp_path):
    model = M.make_bert_cls()
    with torch.no_grad():
        model.bert.embeddings.word_embeddings.weight[M.VOCAB - 1] = float("nan")
    t, _ = trainer(tmp_path, M.trainer_classes()["plain"], model,
                   M.sentences(32, rare={K * B + 1}), M.with_padding(), "make_bert_cls")
    rep, ev = fire(t)
    assert t.state.global_step == 0 and ev["step"] == 0
    assert (rep["origin"]["phase"], rep["origin"]["param"], rep["cause"]) == (
        "weights", "bert.embeddings.word_embeddings.weight", "weights")
    assert f"row(s) {M.VOCAB - 1} of {M.VOCAB}" in rep["hint"]
    assert "resize_token_embeddings" in rep["hint"]


def test_adam_epsilon_zero_is_named_as_the_optimizer_on_rows_absent_from_the_batch(tmp_path):
    """``adam_epsilon=0``: an embedding row no token of the batch used (and the attention's
    key bias, whose gradient softmax's shift invariance makes 0) gets m / sqrt(v) = 0 / 0.
    Which key biases' gradients round to exactly 0 (the first layer's, or both) follows the
    CPU's kernels: the same update without the recorder says which parameters it broke."""
    plain = M.make_bert_cls()
    trainer(tmp_path / "plain", M.trainer_classes()["plain"], plain, M.sentences(32),
            M.with_padding(), record=False, adam_epsilon=0.0, max_steps=1)[0].train()
    broken = [n for n, p in plain.named_parameters() if not torch.isfinite(p).all()]
    assert broken[:3] == ["bert.embeddings.word_embeddings.weight",
                          "bert.embeddings.position_embeddings.weight",
                          "bert.embeddings.token_type_embeddings.weight"], broken
    assert "bert.encoder.layer.0.attention.self.key.bias" in broken, broken
    t, _ = trainer(tmp_path, M.trainer_classes()["plain"], M.make_bert_cls(),
                   M.sentences(32), M.with_padding(), "make_bert_cls", adam_epsilon=0.0)
    rep, ev = fire(t)
    assert ev["step"] == 0 and t.state.global_step == 1  # the update ran: the optimizer's
    assert (rep["origin"]["phase"], rep["event"]["step"], rep["cause"]) == (
        "optimizer", 0, "optimizer")
    assert rep["origin"]["params"] == broken
    assert "with eps=0" in rep["hint"] and "absent from the batch" in rep["hint"]


def test_a_confident_teachers_softmax_underflows_in_the_distillation_kl(tmp_path):
    """The teacher's logits hundreds apart: its softmax is 0 for the other classes, whose
    log is -inf and 0 * -inf NaN in the KL written out."""
    teacher = M.make_bert_cls()
    with torch.no_grad():
        teacher.classifier.weight.mul_(1e4)
    cls = M.trainer_classes()["distill"]
    t, _ = trainer(tmp_path, lambda teacher_=teacher, **kw: cls(teacher=teacher_, **kw),
                   M.make_bert_cls(), M.sentences(32), M.with_padding(), "make_bert_cls",
                   loss=M.DistillKL(2.0))
    rep, ev = fire(t)
    assert t.state.global_step == 0 and ev["step"] == 0
    assert origin(rep) == ("loss", "<loss>", "aten.log", 0, "underflow")
    assert rep["origin"]["source"] == line_of("return (p * (p.log() - log_q))")
    assert rep["origin"]["samples"] == [0, 1, 2, 3]
    assert "log_softmax" in rep["hint"]


def test_infonce_at_clips_temperature_overflows_exp(tmp_path):
    """SimCSE's loss written with exp over tau = 0.01 (CLIP's logit scale of 100): a cosine
    of 1 gives exp(100), beyond float32."""
    t, _ = trainer(tmp_path, M.contrastive_trainer(), M.make_encoder(), M.sentences(32),
                   M.with_padding(), "make_encoder", loss=M.InfoNCE(0.01))
    rep, ev = fire(t)
    assert t.state.global_step == 0 and ev["step"] == 0
    assert origin(rep) == ("loss", "<loss>", "aten.exp", 0, "overflow")
    assert rep["origin"]["source"] == line_of("sim = torch.exp(z1 @ z2.T / self.tau)")
    assert "F.cross_entropy(s, target) for an InfoNCE" in rep["hint"]


def test_a_triplet_whose_positive_is_its_anchor_is_a_distance_at_0(tmp_path):
    """A deduplication miss pairs a sentence with itself: the distance written as sqrt of a
    sum of squares is 0 there and its backward infinite. The anchor and the positive are
    chunks of one batch, which is no deviation from a mean: the hint speaks of two points
    that coincide (before: of a standard deviation written out), and the two rows named are
    the same record (before: not said)."""
    t, _ = trainer(tmp_path, M.triplet_trainer(), M.make_encoder_no_dropout(),
                   M.triplets(12, copied={2 * K + 1}), M.triplet_collator,
                   "make_encoder_no_dropout", loss=M.TripletLoss(),
                   per_device_train_batch_size=2)
    rep, ev = fire(t)
    assert t.state.global_step == K and ev["phase"] == "backward"
    assert origin(rep) == ("backward", "<loss>", "SqrtBackward0", K, "invalid")
    assert rep["origin"]["samples"] == [1, 3]  # the anchor's row and its positive's
    assert rep["origin"]["source"] == line_of("d_ap = (a - p).pow(2).sum(-1).sqrt()")
    assert "two points coincide" in rep["hint"] and "own mean" not in rep["hint"]
    assert ('same record in pairs (1 and 3: kwargs["input_ids"], kwargs["attention_mask"] '
            "equal row for row)") in rep["hint"]


@pytest.mark.parametrize("accumulate", [1, 2])
def test_prompts_whose_answers_truncation_cut_off_are_named_as_labels_masked_out(
        tmp_path, accumulate):
    """Instruction tuning with the prompt labelled -100: a step of long prompts, their answers
    cut by ``max_length``, leaves no label, and the Trainer's ``num_items_in_batch`` (its count
    of labels that are not -100 over the step) is 0, the divisor of transformers' loss. Before,
    the hint read it as a record's missing value filled with 0 ("a price, volume or count of
    0 ... in the samples named", with no sample named); now it is a number given with the
    batch, and the labels beside real tokens are named as masked out."""
    per_step = B * accumulate
    t, _ = trainer(tmp_path, M.trainer_classes()["plain"], M.make_gpt2(),
                   M.sft_rows(48, long_prompt=range(K * per_step, (K + 1) * per_step)),
                   M.sft_collator, "make_gpt2", gradient_accumulation_steps=accumulate)
    rep, ev = fire(t)
    assert t.state.global_step == K and ev["step"] == K
    assert origin(rep) == ("forward", "", "aten.div", K, "invalid")
    path, _, line = rep["origin"]["source"].rpartition(":")
    assert path.endswith("transformers/loss/loss_utils.py")
    assert "/ num_items_in_batch" in Path(path).read_text().splitlines()[int(line) - 1]
    hint = rep["hint"]
    assert 'number given with the batch (kwargs["num_items_in_batch"]' in hint
    assert "a price, volume or count" not in hint
    assert 'kwargs["labels"] is -100 at all' in hint and "answer a max_length truncation" in hint


def test_a_masked_lm_batch_the_collator_masked_nothing_in_is_named(tmp_path):
    """``DataCollatorForLanguageModeling(mlm=True)`` on one-word texts: 15 % masking picks no
    position in some batch, every label is -100 and ``BertForMaskedLM``'s mean is 0/0."""
    t, _ = trainer(tmp_path, M.trainer_classes()["plain"], M.make_bert_mlm(),
                   M.short_texts(48, short=range(48)), M.lm_collator(mlm=True),
                   "make_bert_mlm", max_steps=12)
    rep, ev = fire(t)
    step = t.state.global_step
    assert ev["step"] == step and 0 < step < 12  # (the seed's first batch with no mask)
    assert origin(rep) == ("forward", "", "aten.nll_loss_forward", step, "invalid")
    assert "ignore_index (-100)" in rep["hint"]
    assert 'kwargs["labels"] is -100 at all 12 positions of the batch' in rep["hint"]
    assert "masked-LM collator's random choice" in rep["hint"]
