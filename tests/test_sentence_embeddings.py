"""End to end: sentence-embedding training with sentence-transformers
(``sentence_embeddings_models``: a tiny BERT + mean pooling (+ Normalize) trained by its own
losses and two written by hand), in a manual loop over ``model.preprocess`` features (a
tokenizer's ``BatchEncoding``, passed whole to the model, which writes its outputs into it) and
under ``SentenceTransformerTrainer`` with the Hugging Face callback, until a planted bug fires,
then replayed with the CLI; and a healthy run, which must raise nothing."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("sentence_transformers")
pytest.importorskip("datasets")
pytest.importorskip("accelerate")

import sentence_embeddings_models as M  # noqa: E402
from bundles import nanreplay_json, source_line  # noqa: E402
from sentence_transformers.sentence_transformer import losses  # noqa: E402

from recorder import FlightRecorder, NonFiniteError  # noqa: E402

pytestmark = pytest.mark.usefixtures("in_tests_dir")

FACTORY = "sentence_embeddings_models:"
MODELS = "sentence_embeddings_models.py"


def pair_batches(steps: int, edit=None, bs: int = 8):
    """(anchors, positives, scores) batches; ``edit(step, a, p, s)`` plants a bug."""
    d = M.pairs(steps * bs)
    for i in range(steps):
        a, p = d["anchor"][i * bs:(i + 1) * bs], d["positive"][i * bs:(i + 1) * bs]
        s = torch.tensor(d["score"][i * bs:(i + 1) * bs])
        yield (edit(i, a, p, s) if edit else (a, p, s))


def train(model, loss, opt, batches, autocast=None):
    """The manual loop of sentence-transformers' docs: features by ``model.preprocess``, the
    loss module called on them (it runs the model)."""
    for *texts, labels in batches:
        features = [model.preprocess(t) for t in texts]
        opt.zero_grad()
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=bool(autocast)):
            value = loss(features, labels)
        value.backward()
        opt.step()
    return value


def recorded(tmp_path, model, loss, opt, batches, factory, autocast=None, **kw):
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=loss, out_dir=tmp_path, factory=FACTORY + factory,
                            **kw):
            train(model, loss, opt, batches, autocast)
    return info.value


def test_blank_text_in_hand_written_mean_pooling_is_0_by_0_in_the_pooling(tmp_path):
    # BUG: the pooling divides by the mask's count without the model card's clamp, and anchor 5
    # of step 1 is an empty string: with no [CLS]/[SEP] its attention mask is all 0, 0/0
    def blank(step, a, p, s):
        if step == 1:
            a[5] = ""
        return a, p, s

    model = M.make_hand_pooled_model()
    loss = losses.MultipleNegativesRankingLoss(model, scale=20.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    err = recorded(tmp_path, model, loss, opt, pair_batches(3, blank), "make_hand_pooled_model")
    # (was: a loss event, "the loss is non-finite while the model output is finite", and the
    # replay refused the batch: the BatchEncoding the model took was kept as its repr)
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (1, "forward", "1")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"], o["samples"],
            o["micro_batch"]) == (True, "invalid", "1", "aten.div", "nan", [5], 0), rep
    assert o["source"] == source_line(MODELS, "summed / counts"), o
    assert 'Sample(s) 5 are empty records: batch["attention_mask"]' in rep["hint"], rep["hint"]
    assert rep["problems"] == [], rep["problems"]


def test_blank_text_in_the_cached_loss_no_grad_pass_is_reproduced_inside_the_root(tmp_path):
    # the same blank anchor under CachedMultipleNegativesRankingLoss (GradCache): its first
    # pass embeds mini-batches of 4 under no_grad, an evaluation forward to the recorder, which
    # checks the root's output only; the replay names the pooling inside it
    def blank(step, a, p, s):
        if step == 1:
            a[5] = ""
        return a, p, s

    model = M.make_hand_pooled_model()
    loss = losses.CachedMultipleNegativesRankingLoss(model, scale=20.0, mini_batch_size=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    err = recorded(tmp_path, model, loss, opt, pair_batches(3, blank), "make_hand_pooled_model")
    ev = err.event
    assert (ev["step"], ev["phase"], ev["module"], ev["evaluation"], ev["samples"]) == (
        1, "forward", "", True, [1]), ev
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    # (was: "NOT reproduced" and exit status 1, the op found inside the root the event named)
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["samples"],
            o["batch_rows"]) == (True, "invalid", "1", "aten.div", [1], [5]), rep
    assert o["source"] == source_line(MODELS, "summed / counts"), o


def trainer_event(tmp_path, model, loss, data: dict, factory: str, **args) -> NonFiniteError:
    """``SentenceTransformerTrainer`` over ``data`` with the Hugging Face callback, until the
    event."""
    from datasets import Dataset
    from sentence_transformers import SentenceTransformerTrainer as Trainer
    from sentence_transformers import SentenceTransformerTrainingArguments as Args

    from recorder.huggingface import FlightRecorderCallback

    settings = dict(per_device_train_batch_size=8, num_train_epochs=1, learning_rate=1e-3,
                    report_to=[], save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True)
    args = Args(output_dir=str(tmp_path / "run"), **{**settings, **args})
    cb = FlightRecorderCallback(out_dir=tmp_path / "b", loss_fn=loss, factory=FACTORY + factory)
    trainer = Trainer(model=model, args=args, train_dataset=Dataset.from_dict(data), loss=loss,
                      callbacks=[cb])
    with pytest.raises(NonFiniteError) as info:
        trainer.train()
    return info.value


def test_blank_text_under_the_trainer_with_accumulation_is_reproduced_in_the_pooling(tmp_path):
    # the blank anchor under SentenceTransformerTrainer (batches of 4, 2 accumulated): its
    # features are plain dicts, each module writes its output into them and returns them, so
    # the recorder, reading a call's inputs after it, saw the pooling's NaN among its inputs
    # and named the root
    d = M.pairs(24)
    d["anchor"][19] = ""
    model = M.make_hand_pooled_model()
    loss = losses.MultipleNegativesRankingLoss(model, scale=20.0)
    err = trainer_event(tmp_path, model, loss, {"anchor": d["anchor"], "positive": d["positive"]},
                        "make_hand_pooled_model", per_device_train_batch_size=4,
                        gradient_accumulation_steps=2, max_grad_norm=1.0)
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (1, "forward", "")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    # (was: "NOT reproduced", exit status 1, with the op found in '1')
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["micro_batch"],
            o["samples"]) == (True, "invalid", "1", "aten.div", 0, [2]), rep
    assert o["source"] == source_line(MODELS, "summed / counts"), o
    assert 'Sample(s) 2 are empty records: batch["attention_mask"]' in rep["hint"], rep["hint"]
    assert any("'1' returns the dict it was given with its output written into it" in p
               for p in rep["problems"]), rep["problems"]


def test_nan_similarity_score_under_the_trainer_is_an_input_of_the_loss(tmp_path):
    # BUG: one gold score of the STS-like data set is NaN (a missing annotation): the
    # CosineSimilarityLoss's MSE against it is NaN; SentenceTransformerTrainer + the callback
    d = M.pairs(24)
    d["score"][19] = math.nan
    model = M.make_model()
    loss = losses.CosineSimilarityLoss(model)
    err = trainer_event(tmp_path, model, loss, {"sentence1": d["anchor"],
                                                "sentence2": d["positive"], "score": d["score"]},
                        "make_model")
    assert (err.event["step"], err.event["phase"], err.event["samples"]) == (1, "input", [2])
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["phase"], o["samples"]) == (
        True, "input", "input", [2]), rep
    assert "loss_args[1] (labels)" in rep["hint"] and "fix the data pipeline" in rep["hint"]
    # (was also: "the loss's attribute(s) model.model_card_data ..., model.0.processor
    # (TokenizersBackend) ... could not be stored in the bundle", of the model the loss holds,
    # which the re-run takes from the factory)
    assert rep["problems"] == [], rep["problems"]


def test_log_of_softmax_under_fp16_autocast_underflows(tmp_path):
    # BUG: a hand-written InfoNCE takes log(softmax(scores)) of dot-product scores under
    # float16 autocast: the positives' probabilities of rows 6 and 7 at step 1 are below
    # float16's range, rounded to 0, and their log is -inf
    model = M.make_plain_model()
    loss = M.InfoNCELoss(model, scale=20.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    err = recorded(tmp_path, model, loss, opt, pair_batches(3), "make_plain_model",
                   autocast=torch.float16)
    assert (err.event["step"], err.event["phase"]) == (1, "loss")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "underflow", "<loss>", "aten.log", "-inf", [6, 7]), rep
    assert o["source"] == source_line(MODELS, "torch.log(torch.diagonal(probs))"), o
    assert "log_softmax instead of log(softmax)" in rep["hint"], rep["hint"]


def test_duplicate_texts_in_a_triplet_are_a_backward_only_nan_of_sqrt(tmp_path):
    # BUG: positive 4 of step 1 is its anchor's own text (a deduplication missed): identical
    # embeddings, a distance sqrt(0) = 0 in the forward, and sqrt's infinite slope times 0 in
    # the backward
    model = M.make_model()
    loss = M.HandTripletLoss(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    d = M.triplets(24)

    def batches():
        for i in range(3):
            a, p, n = (d[k][i * 8:(i + 1) * 8] for k in ("anchor", "positive", "negative"))
            if i == 1:
                p[4] = a[4]
            yield a, p, n, None

    err = recorded(tmp_path, model, loss, opt, batches(), "make_model")
    assert (err.event["step"], err.event["phase"]) == (1, "backward")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["phase"], o["module"], o["op"], o["samples"]) == (
        True, "invalid", "backward", "<loss>", "SqrtBackward0", [4]), rep
    assert o["source"] == source_line(MODELS, "d_ap = torch.sqrt("), o
    assert "torch.linalg.vector_norm" in rep["hint"], rep["hint"]


def test_exp_of_scores_over_a_small_temperature_overflows_float16(tmp_path):
    # BUG: InfoNCE written as its formula, exp(sim / 0.05) over the row's sum, under float16
    # autocast: a cosine above 0.55 over 0.05 is above 11.09, whose exp is beyond 65504
    model = M.make_model()
    loss = M.ExpInfoNCELoss(model, temperature=0.05)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    err = recorded(tmp_path, model, loss, opt, pair_batches(2), "make_model",
                   autocast=torch.float16)
    assert (err.event["step"], err.event["phase"]) == (0, "loss")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "overflow", "<loss>", "aten.exp", "+inf", list(range(8))), rep
    assert o["source"] == source_line(MODELS, "e = torch.exp(sim)"), o
    assert "torch.softmax(s, dim)" in rep["hint"], rep["hint"]


def test_acos_of_a_duplicate_pair_at_its_target_is_a_pole_not_a_mask(tmp_path):
    # BUG: an angle regression takes acos of the unit embeddings' dot; pair 3 of step 1 is a
    # text and itself, scored 1: cos = 1, acos's slope is infinite, and the squared error's
    # gradient is exactly 0 there (the prediction is its target): 0 * inf = NaN
    def duplicate(step, a, p, s):
        if step == 1:
            p[3], s[3] = a[3], 1.0
        return a, p, s

    model = M.make_model()
    loss = M.AngularLoss(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    err = recorded(tmp_path, model, loss, opt, pair_batches(3, duplicate), "make_model")
    assert (err.event["step"], err.event["phase"]) == (1, "backward")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "invalid", "<loss>", "AcosBackward0", "nan", [3]), rep
    assert o["source"] == source_line(MODELS, "angle = torch.acos(cos)"), o
    assert "cos.clamp(-1 + eps, 1 - eps)" in rep["hint"], rep["hint"]
    # (was: "the forward dropped the op's output there after the op (masked_fill,
    # torch.where, ...)": no mask here, the loss fits the pair)
    assert "masked_fill" not in rep["hint"], rep["hint"]
    assert "made so by PowBackward0 of an error exactly 0" in rep["hint"], rep["hint"]


def test_exponential_lr_with_gamma_above_1_names_the_schedule_and_the_decay(tmp_path):
    # BUG: ExponentialLR(gamma=10) where a decay by 10x a step was meant (gamma=0.1): from
    # step 6 AdamW's lr * weight_decay is above 2, the decoupled decay flips and grows every
    # weight 10x and more per update, and the first LayerNorm's statistics overflow
    model = M.make_model()
    loss = losses.CoSENTLoss(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=10.0)

    def batches():
        for b in pair_batches(12):
            yield b
            sched.step()

    err = recorded(tmp_path, model, loss, opt, batches(), "make_model", lr_scheduler=sched)
    assert (err.event["phase"], err.event["module"]) == (
        "forward", "0.model.encoder.layer.0.attention.output.LayerNorm"), err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["samples"]) == (
        True, "overflow", "0.model.encoder.layer.0.attention.output.LayerNorm",
        "aten.native_layer_norm", list(range(8))), rep
    assert rep["event"]["step"] == err.event["step"] == 9
    assert "ExponentialLR with gamma > 1" in rep["hint"], rep["hint"]
    assert "lr * weight_decay" in rep["hint"], rep["hint"]


def test_float16_weights_under_adamw_lose_its_eps(tmp_path):
    # BUG: the model loaded in float16 (model_kwargs dtype) and trained by AdamW as it is: its
    # eps=1e-8 is 0 in float16, and every entry whose second moment is 0 (rows of words absent
    # from the batch, gradients too small to square) divides by 0 in the first update
    model = M.make_half_model()
    loss = losses.MultipleNegativesRankingLoss(model, scale=20.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    err = recorded(tmp_path, model, loss, opt, pair_batches(2), "make_half_model",
                   guard_optimizer=True)
    assert (err.event["step"], err.event["phase"]) == (0, "optimizer")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["op"], o["param"]) == (
        True, "optimizer", "aten.addcdiv_", "0.model.embeddings.word_embeddings.weight"), rep
    assert "eps=1e-08 is 0 in float16" in rep["hint"], rep["hint"]
    assert "keep the weights and optimizer state in float32" in rep["hint"], rep["hint"]


def _healthy(recorder_dir=None):
    torch.manual_seed(0)
    model = M.make_model()
    loss = losses.MatryoshkaLoss(model, losses.MultipleNegativesRankingLoss(model, scale=20.0),
                                 matryoshka_dims=[32, 16, 8])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if recorder_dir is None:
        value = train(model, loss, opt, pair_batches(3))
    else:
        with FlightRecorder(model, opt, loss_fn=loss, out_dir=recorder_dir,
                            factory=FACTORY + "make_model"):
            value = train(model, loss, opt, pair_batches(3))
    return value, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_healthy_matryoshka_training_raises_nothing_and_is_bit_identical(tmp_path):
    plain, w0 = _healthy()
    value, w1 = _healthy(tmp_path)
    assert torch.isfinite(value) and not list(tmp_path.iterdir())
    assert torch.equal(plain, value)
    assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0)
