"""End to end: Hugging Face ``transformers`` models built from tiny configs
(``hf_model_zoo_models``: ``LlamaForCausalLM`` and ``LlamaModel`` under pooled heads,
``T5ForConditionalGeneration``, ``BertForMaskedLM`` fed by ``DataCollatorForLanguageModeling``,
``ViTForImageClassification``, ``Wav2Vec2ForCTC``), fine-tuned with the model cards' plain loop
(AdamW, ``get_linear_schedule_with_warmup``, autocast, clipping) under ``FlightRecorder`` until
a planted bug of the domain fires, then replayed with the CLI from the factory's rebuilt
model: the step, the HF module path, the op, the samples, the cause and the transformers
source line are checked against what was planted."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import hf_model_zoo_models as M  # noqa: E402
import torch  # noqa: E402
from bundles import nanreplay_json, source_line  # noqa: E402

from recorder import FlightRecorder, NonFiniteError  # noqa: E402

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def run(tmp_path, factory, batches, loss=None, dtype=torch.bfloat16, prep=None, **opt_kw):
    """Train ``factory``'s model over ``batches`` until the event; its JSON report."""
    model = getattr(M, factory)()
    if prep is not None:
        prep(model)
    opt = torch.optim.AdamW(model.parameters(), **{"lr": 1e-3, **opt_kw})
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=loss, out_dir=tmp_path,
                            factory=f"hf_model_zoo_models:{factory}"):
            M.train(model, opt, batches, loss, dtype)
    return nanreplay_json(info.value.bundle_path, "--json", code=None)


def origin(rep):
    o = rep["origin"]
    return rep["event"]["step"], o["phase"], o["module"], o["op"], rep["cause"]


def test_healthy_llama_raises_nothing_and_trains_identically(tmp_path):
    """A causal LM with left padding, SDPA, RoPE, bf16 autocast, warmup and clipping, a
    custom shifted loss: no event, the same weights bit for bit with and without the
    recorder."""
    weights = []
    for record in (False, True):
        model = M.make_llama()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loss = M.ShiftedLMLoss()
        if record:
            with FlightRecorder(model, opt, loss_fn=loss, out_dir=tmp_path,
                                factory="hf_model_zoo_models:make_llama") as rec:
                M.train(model, opt, M.causal_lm_batches(3), loss, torch.bfloat16)
            assert rec.event is None and rec.step == 3
        else:
            M.train(model, opt, M.causal_lm_batches(3), loss, torch.bfloat16)
        weights.append(model.state_dict())
    assert list(tmp_path.glob("*.nan")) == []
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_all_padding_row_in_a_mean_pool_is_0_by_0_on_that_row(tmp_path):
    rep = run(tmp_path, "make_llama_pooled", M.classify_batches(3, empty=(2, 1)),
              torch.nn.CrossEntropyLoss())
    assert origin(rep) == (2, "forward", "", "aten.div", "invalid")
    assert rep["origin"]["samples"] == [1]
    assert rep["origin"]["source"] == source_line("hf_model_zoo_models.py",
                                                  "pooled = (h * m).sum(1) / m.sum(1)  #")
    assert "kwargs[\"attention_mask\"] (0/1 data) has no entry set" in rep["hint"]


def test_all_padding_row_under_a_hand_written_norm_is_a_backward_only_nan(tmp_path):
    rep = run(tmp_path, "make_llama_cosine", M.classify_batches(3, empty=(2, 1)),
              torch.nn.CrossEntropyLoss())
    assert origin(rep) == (2, "backward", "", "SqrtBackward0", "invalid")
    assert rep["origin"]["samples"] == [1]
    assert rep["origin"]["source"] == source_line("hf_model_zoo_models.py", "sqrt()  # the bug")
    assert "model.layers.0.self_attn.q_proj.weight" in rep["origin"]["params"]


def test_ctc_target_longer_than_its_clip_is_named_with_the_transformers_line(tmp_path):
    """Wav2Vec2ForCTC's loss is computed in transformers' ``loss_ctc.py``, a call spread over
    more lines than the report joins: its source text is cut with "..." (it crashed the
    replay with tokenize's "EOF in multi-line statement")."""
    rep = run(tmp_path, "make_wav2vec2", M.audio(3, long_at=(2, 1)), dtype=None)
    assert origin(rep) == (2, "forward", "", "aten._ctc_loss", "invalid")
    assert rep["origin"]["samples"] == [1]
    src = rep["origin"]["source"]
    assert src.endswith("transformers/loss/loss_ctc.py:" + src.rsplit(":", 1)[1])
    text = rep["source_lines"][src]
    assert text.startswith("return nn.functional.ctc_loss( log_probs,") and text.endswith(" ...")
    assert "target of 30 labels" in rep["hint"] and "ctc_zero_infinity=True" in rep["hint"]


def test_t5_feed_forward_overflows_float16_in_wo(tmp_path):
    rep = run(tmp_path, "make_t5", M.seq2seq_batches(2), dtype=torch.float16, prep=M.hot_ff)
    assert origin(rep) == (0, "forward", "encoder.block.1.layer.1.DenseReluDense.wo",
                           "aten.mm", "overflow")
    assert rep["origin"]["samples"] == [0, 1, 2, 3]
    assert rep["origin"]["source"].endswith("transformers/models/t5/modeling_t5.py:94")
    assert rep["origin"].get("called_from") is None, rep["origin"].get("called_from")
    assert "beyond float16's largest value" in rep["hint"]
    assert "autocast to bfloat16 (float32's range)" in rep["hint"]


def test_masked_lm_batch_with_no_masked_token_is_0_by_0_in_bert_loss(tmp_path):
    batches = M.mlm_batches(4, short_at=3)
    assert (batches[3]["labels"] == -100).all() and (batches[2]["labels"] != -100).any()
    rep = run(tmp_path, "make_bert_mlm", batches)
    assert origin(rep) == (3, "forward", "", "aten.nll_loss_forward", "invalid")
    assert rep["origin"]["source"].endswith("transformers/models/bert/modeling_bert.py:973")
    assert "masked-LM collator" in rep["hint"] and "(labels != -100).any()" in rep["hint"]


def test_nan_pixel_in_an_image_is_the_input_on_its_row(tmp_path):
    rep = run(tmp_path, "make_vit", M.images(3, nan_at=(2, 3)))
    assert origin(rep) == (2, "input", None, None, "input")
    assert rep["origin"]["samples"] == [3]
    assert rep["origin"]["tensor"] == 'kwargs["pixel_values"]'


def test_adamw_with_eps_0_makes_never_used_rows_nan(tmp_path):
    rep = run(tmp_path, "make_bert_mlm", M.mlm_batches(2), eps=0.0)
    assert origin(rep) == (0, "optimizer", None, None, "optimizer")
    assert rep["origin"]["param"] == "bert.embeddings.position_embeddings.weight"
    assert "bert.encoder.layer.0.attention.self.key.bias" in rep["origin"]["params"]
    assert "eps=0" in rep["hint"] and "gradient was all 0" in rep["hint"]


def test_focal_loss_log_of_a_float16_softmax_underflow_on_its_rows(tmp_path):
    """ViT with a re-initialised head under float16 autocast: the focal loss's softmax of
    sharpened logits rounds a true class's probability to 0 (2e-14 in float64) and its log is
    -inf, an underflow (float32 holds it) on the rows where it happened."""
    rep = run(tmp_path, "make_vit", M.images(2), M.FocalLoss(), dtype=torch.float16,
              prep=M.new_head)
    assert origin(rep) == (0, "loss", "<loss>", "aten.log", "underflow")
    assert rep["origin"]["samples"] == [2, 3]
    assert rep["origin"]["source"] == source_line("hf_model_zoo_models.py", "pt.log()")
    assert "below float16's smallest normal" in rep["hint"] and "log_softmax" in rep["hint"]


def test_t5_in_pure_float16_names_adamw_eps_and_the_overflow_t5_clamped(tmp_path):
    """``model.half()`` (weights and AdamW state in float16): wo's +inf is clamped by T5's
    float16 block (no event there), and AdamW's eps=1e-8, 0 in float16, makes the update 0/0.
    The report names the optimizer and, as a precursor, the overflow the model absorbed."""
    rep = run(tmp_path, "make_t5", M.seq2seq_batches(1), dtype=None,
              prep=lambda m: M.hot_ff(m).half())
    assert origin(rep) == (0, "optimizer", None, None, "optimizer")
    assert "eps=1e-08 is 0 in float16" in rep["hint"]
    assert [(p["step"], p["kind"], p["detail"].split("'s ")[0]) for p in rep["precursors"]] == \
        [(0, "fp16_overflow_absorbed", "encoder.block.1.layer.1.DenseReluDense.wo")]
