"""End to end: Hugging Face architectures the model zoo test leaves out
(``hf_architectures_models``: BART, Whisper, CLIP, DeBERTa-v2, Mixtral, RoBERTa multi-label),
fine-tuned with the model cards' plain loop under ``FlightRecorder``: healthy runs (an empty
text's all-zero attention mask among them, which transformers masks with finite values) give
the same losses bit for bit and no event; each planted bug is replayed with the CLI from the
factory's model and named by step, HF module path, op, samples and cause."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import hf_architectures_models as M  # noqa: E402
import torch  # noqa: E402
from bundles import nanreplay_json  # noqa: E402

from recorder import FlightRecorder, NonFiniteError  # noqa: E402

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def record(tmp_path, factory, batches, prep=None, dtype=None):
    """Train ``factory``'s model over ``batches`` under the recorder: (recorder, losses)."""
    model = getattr(M, factory)()
    if prep is not None:
        prep(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with FlightRecorder(model, opt, out_dir=tmp_path,
                        factory=f"hf_architectures_models:{factory}") as rec:
        losses = M.train(model, opt, batches, dtype)
    return rec, losses


def replayed(tmp_path, factory, batches, prep=None, dtype=None):
    """The JSON report of the event ``factory``'s run ends with."""
    with pytest.raises(NonFiniteError) as info:
        record(tmp_path, factory, batches, prep, dtype)
    return nanreplay_json(info.value.bundle_path, code=None)


def origin(rep):
    o = rep["origin"]
    return rep["event"]["step"], o["phase"], o.get("module"), o.get("op"), rep["cause"]


@pytest.mark.parametrize("factory, batches", [
    ("make_bart", lambda: M.seq2seq(2, empty=(1, 2))),
    ("make_whisper", lambda: M.speech(2)),
    ("make_clip", lambda: M.image_text(2)),
    ("make_deberta", lambda: M.classified(2, empty=(1, 2))),
    ("make_mixtral", lambda: M.causal_lm(2, empty=(1, 2))),
    ("make_roberta", lambda: M.classified(2, empty=(1, 2), multi_label=True)),
])
def test_healthy_run_is_bit_identical_and_raises_nothing(tmp_path, factory, batches):
    model = getattr(M, factory)()
    plain = M.train(model, torch.optim.AdamW(model.parameters(), lr=1e-3), batches())
    rec, losses = record(tmp_path, factory, batches())
    assert rec.event is None and losses == plain
    assert list(tmp_path.glob("*.nan")) == []


def test_bart_batch_with_every_label_ignored_is_0_by_0_in_its_loss(tmp_path):
    batches = M.seq2seq(3, unlabelled_at=2)
    rep = replayed(tmp_path, "make_bart", batches)
    assert origin(rep) == (2, "forward", "", "aten.nll_loss_forward", "invalid")
    assert "/transformers/models/bart/modeling_bart.py:" in rep["origin"]["source"]
    assert "(labels != -100).any()" in rep["hint"]


def test_nan_log_mel_bin_is_whispers_input_on_its_row(tmp_path):
    rep = replayed(tmp_path, "make_whisper", M.speech(3, nan_at=(2, 1)))
    assert origin(rep) == (2, "input", None, None, "input")
    assert rep["origin"]["tensor"] == 'kwargs["input_features"]'
    assert rep["origin"]["samples"] == [1]


def test_clip_logit_scale_set_to_the_temperature_overflows_exp(tmp_path):
    """transformers' CLIPModel does not clamp ``logit_scale``: exp(100) is past float32."""
    rep = replayed(tmp_path, "make_clip", M.image_text(2), prep=M.temperature_as_scale)
    assert origin(rep) == (0, "forward", "", "aten.exp", "overflow")
    assert rep["origin"]["samples"] == list(range(M.B))
    assert "/transformers/models/clip/modeling_clip.py:" in rep["origin"]["source"]
    assert "the parameter logit_scale (100)" in rep["hint"]
    assert "for a parameter the model exponentiates" in rep["hint"]


def test_mixtral_router_past_float16_names_the_gate_not_an_exponent(tmp_path):
    """The router's weight cast to float16 under autocast overflows: the gate and its
    initial value, without the advice for a log-scale parameter (nothing exponentiates it)."""
    rep = replayed(tmp_path, "make_mixtral", M.causal_lm(2), prep=M.hot_router,
                   dtype=torch.float16)
    assert origin(rep) == (0, "forward", "model.layers.0.mlp.gate", "aten._to_copy",
                           "overflow")
    assert "has not updated model.layers.0.mlp.gate.weight yet" in rep["hint"]
    assert "fix that initialisation" in rep["hint"] and "exponentiates" not in rep["hint"]


def test_missing_multi_label_target_is_a_label_to_mask_not_a_feature_to_impute(tmp_path):
    """RoBERTa's multi-label head computes BCE-with-logits from ``labels`` itself: an unknown
    label read as NaN is a target to leave out of the loss, not a feature to impute or
    ``allow_nan`` (which the loss would still take)."""
    rep = replayed(tmp_path, "make_roberta",
                   M.classified(3, multi_label=True, missing_at=(2, 1, 2)))
    assert origin(rep) == (2, "input", None, None, "input")
    assert rep["origin"]["tensor"] == 'kwargs["labels"]'
    assert rep["origin"]["samples"] == [1]
    hint = rep["hint"]
    assert "target of its own loss (F.binary_cross_entropy_with_logits)" in hint
    assert "sample 1 at entries 2 (of 4)" in hint and "~labels.isnan()" in hint
    assert "allow_nan=[" not in hint and "training-set mean" not in hint
