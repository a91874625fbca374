"""End to end: LLM post-training with TRL (``trl_stack_models``: a tiny ``LlamaForCausalLM``
and a ``LlamaForSequenceClassification`` reward model built from configs, a word-level
``PreTrainedTokenizerFast``, ``datasets.Dataset.from_dict`` data) run by TRL's own trainers —
``SFTTrainer`` on prompt / completion pairs (completion-only loss), ``DPOTrainer`` with a
reference model, ``RewardTrainer`` with a margin column — with their defaults (bf16 autocast,
gradient checkpointing, clipping, a linear schedule) under ``FlightRecorderCallback`` until a
planted bug of the domain fires, then replayed with the CLI.

TRL's SFT and DPO trainers patch the model they train (``add_fused_lm_head``: the forward
returns per-token log-probabilities, not logits), so the replay's factory must build the model
so patched (``make_fused_llama``); one that does not is refused in one line naming the patch."""

from __future__ import annotations

from pathlib import Path

import pytest

trl = pytest.importorskip("trl")
pytest.importorskip("accelerate")

import torch  # noqa: E402
import trl_stack_models as M  # noqa: E402
from bundles import invoke_cli, nanreplay_json, one_error_line  # noqa: E402
from trl import (  # noqa: E402
    DPOConfig,
    DPOTrainer,
    RewardConfig,
    RewardTrainer,
    SFTConfig,
    SFTTrainer,
)

from recorder import NonFiniteError  # noqa: E402
from recorder.bundle import read_bundle  # noqa: E402
from recorder.huggingface import FlightRecorderCallback  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("in_tests_dir"),
    # TRL's configs default gradient_checkpointing=True, which transformers renames
    pytest.mark.filterwarnings("ignore:`[a-z_]*gradient_checkpointing[a-z_]*` is deprecated"
                               ":FutureWarning"),
]

B = 4  # records (SFT) or preference pairs (DPO, reward) a batch


def trainer(tmp_path, cls, config, data, factory, model=None, record=True, **kw):
    """A TRL trainer over ``data`` with the recorder's callback (``factory`` rebuilds the
    model); ``kw``: the config's arguments, and ``ref_model``."""
    ref = {"ref_model": kw.pop("ref_model")} if "ref_model" in kw else {}
    args = dict(output_dir=str(tmp_path / "o"), per_device_train_batch_size=B, max_steps=2,
                learning_rate=1e-3, report_to=[], save_strategy="no", use_cpu=True,
                disable_tqdm=True, logging_strategy="no", seed=0, max_length=32)
    cb = FlightRecorderCallback(out_dir=tmp_path / "b", factory=f"trl_stack_models:{factory}")
    t = cls(model=model or M.make_llama(), args=config(**{**args, **kw}), train_dataset=data,
            processing_class=M.make_tokenizer(), callbacks=[cb] if record else [], **ref)
    return t, cb


def fire(t):
    with pytest.raises(NonFiniteError) as info:
        t.train()
    return info.value


def origin(rep):
    o = rep["origin"]
    return rep["event"]["step"], o["phase"], o["module"], o["op"], rep["cause"]


def test_healthy_sft_raises_nothing_and_trains_identically(tmp_path):
    """SFT with TRL's defaults (bf16 autocast, gradient checkpointing, clipping at 1.0) and
    gradient accumulation: no event, and the same weights bit for bit with and without the
    recorder."""
    weights = []
    for record in (False, True):
        t, cb = trainer(tmp_path / str(record), SFTTrainer, SFTConfig, M.sft_data(16),
                        "make_fused_llama", record=record, max_steps=2,
                        gradient_accumulation_steps=2)
        t.train()
        weights.append({k: v.clone() for k, v in t.model.state_dict().items()})
        if record:
            assert cb.recorder.event is None and cb.recorder.step == 2
            assert list((tmp_path / "True" / "b").glob("*.nan")) == []
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


@pytest.fixture(scope="module")
def lr_bundle(tmp_path_factory):
    """SFT with a learning rate of 1e30 (a config's exponent typo): the first update throws
    the weights to 1e27, and step 1's first projection overflows bf16 autocast's range."""
    tmp = tmp_path_factory.mktemp("lr")
    t, _ = trainer(tmp, SFTTrainer, SFTConfig, M.sft_data(16), "make_fused_llama",
                   learning_rate=1e30)
    return fire(t)


def test_sft_learning_rate_blowup_names_the_overflow_and_the_update(lr_bundle):
    assert (lr_bundle.event["step"], lr_bundle.event["phase"]) == (1, "forward")
    rep = nanreplay_json(lr_bundle.bundle_path)
    assert origin(rep) == (1, "forward", "model.layers.0.self_attn.q_proj", "aten.mm",
                           "overflow"), rep["hint"]
    assert rep["origin"]["samples"] == list(range(B))
    assert "lower the learning rate" in rep["hint"]
    assert [p["kind"] for p in rep["precursors"]][:1] == ["weight_jump"]


def test_factory_without_the_trainers_patch_is_refused_in_one_line(lr_bundle):
    """``--factory make_llama`` builds the class's forward, which returns logits: the re-run
    crashed with 'Mismatch in shape: grad_output[0] has a shape of [4, 11] and output[0] has a
    shape of [4, 12, 94]'. Now one line names TRL's patch and how to apply it."""
    err = one_error_line(invoke_cli(lr_bundle.bundle_path, "--json", "--factory",
                                    "trl_stack_models:make_llama"))
    assert "trl.trainer.utils.add_fused_lm_head.<locals>._fused_forward" in err, err
    assert "call trl.trainer.utils.add_fused_lm_head(model) in the factory" in err, err
    assert "Mismatch in shape" not in err


def test_dpo_huge_beta_names_the_loss_scale_not_a_pole(tmp_path):
    """DPO with beta = 1e38: the loss sends a gradient of 1.25e37 into the policy's
    log-probabilities, which the backward of the final RMSNorm takes past float32. The hint
    said 'the op's input is close to its pole (a denominator clamped to a tiny eps)'; the
    variance there is O(1): it now names the entering gradient and the coefficient."""
    t, _ = trainer(tmp_path, DPOTrainer, DPOConfig, M.preference_data(16), "make_fused_llama",
                   beta=1e38, ref_model=M.make_llama())
    err = fire(t)
    rep = nanreplay_json(err.bundle_path)
    assert origin(rep) == (0, "backward", "model.norm", "RsqrtBackward0", "overflow"), \
        rep["hint"]
    assert rep["origin"]["samples"] == list(range(2 * B))
    assert "gradient entering the model's output was already 1.25e+37" in rep["hint"]
    assert "DPO's beta" in rep["hint"] and "near its pole" not in rep["hint"]


def test_dpo_float16_reference_names_the_pair_and_the_trainers_loss(tmp_path):
    """The reference model converted to float16: a rare word's embedding row beyond 65504 is
    inf, so the reference log-probabilities of the pair holding it are NaN, and so is DPO's
    loss and its gradient into both of the pair's rows (gradient accumulation: 2 pairs a
    micro-batch, 2 micro-batches a step). The policy re-runs finite: the hint told to pass a
    loss module to the callback and call it in compute_loss (TRL's trainer owns that loss); it
    now says TRL's trainer combined values the model never took."""
    t, _ = trainer(tmp_path, DPOTrainer, DPOConfig, M.preference_data(16, rare_at=9),
                   "make_fused_llama", ref_model=M.make_half_reference(),
                   per_device_train_batch_size=2, gradient_accumulation_steps=2)
    err = fire(t)
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["micro_batch"], rep["cause"]) == (
        0, "loss", 1, None), rep["hint"]
    meta, tensors = read_bundle(err.bundle_path)
    ids = tensors["batch/1/0"]  # the micro-batch's 2 chosen rows, then their rejected rows
    assert o["samples"] == [0, 2] and (ids[0] == M.RARE_ID).any()
    assert not (ids[1:] == M.RARE_ID).any() and not (tensors["batch/0/0"] == M.RARE_ID).any()
    assert "trl's Trainer computed this loss" in rep["hint"]
    assert "reference model" in rep["hint"] and "compute_loss" not in rep["hint"]


def test_reward_nan_margin_names_the_rows_of_its_pair(tmp_path):
    """A preference pair whose annotators' margin is missing (NaN): ``RewardTrainer`` passes
    the margin column, one value per pair ``(B,)``, into the model's call beside the chosen
    then rejected rows ``(2B, T)``. The report said the margin is 'not per sample: every sample
    goes through it (a mask, a bias or a table)', no sample to blame; it now names the pair's
    two rows of the batch."""
    data = M.reward_data(16, nan_margin_at=9)
    t, _ = trainer(tmp_path, RewardTrainer, RewardConfig, data, "make_reward_model",
                   model=M.make_reward_model())
    err = fire(t)
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["tensor"], rep["cause"]) == (
        err.event["step"], "input", 'kwargs["margin"]', "input"), rep["hint"]
    (pair,) = o["grouped"]["rows"]
    assert o["samples"] == [pair, pair + B], rep["hint"]
    meta, tensors = read_bundle(err.bundle_path)
    tok = M.make_tokenizer()
    for row, text in zip(o["samples"], (data[9]["chosen"], data[9]["rejected"])):
        ids = tok(text)["input_ids"]
        assert tensors["batch/0/0"][row, :len(ids)].tolist() == ids
    assert f"the batch's rows r, r + {B}" in rep["hint"] and "no sample" not in rep["hint"]


def test_sft_nan_checkpoint_names_the_weight(tmp_path):
    """A GPT-2 policy from a checkpoint with one NaN weight (an adapter merge's 0 / 0): a
    weights event at step 0, read first by layer 1's MLP projection."""
    t, _ = trainer(tmp_path, SFTTrainer, SFTConfig, M.sft_data(16), "make_fused_gpt2",
                   model=M.nan_checkpoint_gpt2())
    err = fire(t)
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["param"], rep["cause"]) == (
        0, "weights", "transformer.h.1.mlp.c_fc.weight", "weights"), rep["hint"]
    assert o["samples"] == list(range(B))
    assert "1 of 4096" in rep["hint"] and "came in so" in rep["hint"]


def test_sft_logits_overflow_in_the_fused_head_names_its_matmul(tmp_path):
    """A head row of 1e38 (finite): the fused LM head's logits overflow in its tile matmul,
    ``torch.mm(hidden, w.t(), out=tile)`` into a reused ``torch.empty`` buffer. The report named
    ``aten.full`` filling the running max with its literal -inf ('on purpose, a mask: record
    with allow_inf'), because the buffer's old contents counted as the matmul's inputs."""
    t, _ = trainer(tmp_path, SFTTrainer, SFTConfig, M.sft_data(16), "make_fused_llama",
                   model=M.loud_head_llama())
    err = fire(t)
    rep = nanreplay_json(err.bundle_path)
    assert origin(rep) == (0, "forward", "", "aten.mm", "overflow"), rep["hint"]
    assert rep["origin"]["source"].startswith(
        str(Path(trl.__file__).parent / "kernels" / "chunked_logprob.py")), rep["origin"]
    assert "allow_inf" not in rep["hint"] and not any("allow_inf" in p for p in rep["problems"])
