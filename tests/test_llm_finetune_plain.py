"""End to end on LoRA fine-tuning of a tiny Llama-style decoder in plain PyTorch, the way
torchtune's and lit-gpt's recipes write it (``llm_finetune_plain_models``): packed documents
with per-document position ids, a block-causal mask through SDPA, activation checkpointing per
layer, chunked cross-entropy normalised by the unmasked tokens of the whole step across
micro-batches, AdamW with warmup and cosine decay, global-norm clipping. Each planted bug fires
under the recorder and is replayed with the CLI; the healthy runs raise no event and train
bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib
import math

import llm_finetune_plain_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

STEPS = 3


def cosine_with_warmup(step: int, warmup: int = 1, total: int = STEPS) -> float:
    """torchtune's get_cosine_schedule_with_warmup."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def train(make: str, out_dir, record: bool = True, accum: int = 2, per_micro: bool = False,
          ignored_micro: bool = False, pad_rows=(), eps: float = 1e-8, loss: str = "chunked",
          lr: float = 3e-3, clip: float | None = 1.0):
    """The recipe's loop: ``accum`` micro-batches per step, the loss summed over tokens and
    divided by the unmasked tokens of the step (``per_micro``: of each micro-batch, the bug),
    clip at ``clip``, AdamW over the adapters only. ``ignored_micro``: the last step's last
    micro-batch holds only -100 labels (prompts whose responses were truncated away)."""
    model = getattr(M, make)()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                            eps=eps, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine_with_warmup)
    base_loss = {"chunked": M.token_loss, "softmax": M.softmax_ce,
                 "stable": M.stable_softmax_ce}[loss]
    g = torch.Generator().manual_seed(0)
    rec = FlightRecorder(model, opt, loss_fn=base_loss, out_dir=out_dir, lr_scheduler=sched,
                         factory=f"llm_finetune_plain_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else base_loss
        for step in range(STEPS):
            last = step == STEPS - 1
            micro = [M.packed_batch(g, pad_rows=pad_rows,
                                    all_ignored=ignored_micro and last and i == accum - 1)
                     for i in range(accum)]
            step_tokens = sum((lb != -100).sum() for *_, lb in micro)
            for tokens, pos, doc_ids, labels in micro:
                logits = model(tokens, pos, doc_ids)
                if loss != "chunked":
                    out = loss_fn(logits, labels) / accum
                else:
                    count = (labels != -100).sum() if per_micro else step_tokens
                    out = loss_fn(logits, labels, count)
                out.backward()
            if clip is not None:  # (torchtune's LoRA configs: clip_grad_norm: null)
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
    return model


def train_preference(out_dir, record: bool = True, loss: str = "dpo", identical=None):
    """A DPO recipe: the LoRA policy against a frozen reference built by the same factory
    (its adapters' B at 0: the base model), the reference's logits under no_grad passed to
    the loss; pair ``identical`` of the last step is one whose chosen equals its rejected."""
    model, ref = M.make_llama(), M.make_llama().eval().requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    base_loss = M.dpo_loss if loss == "dpo" else M.ipo_loss
    g = torch.Generator().manual_seed(0)
    rec = FlightRecorder(model, opt, loss_fn=base_loss, out_dir=out_dir,
                         factory="llm_finetune_plain_models:make_llama") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else base_loss
        for step in range(STEPS):
            tokens, pos, doc_ids, labels = M.preference_batch(
                g, identical=identical if step == STEPS - 1 else None)
            with torch.no_grad():
                ref_logits = ref(tokens, pos, doc_ids)
            loss_fn(model(tokens, pos, doc_ids), ref_logits, labels).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
    return model


def fire(make: str, tmp_path, **kw):
    with pytest.raises(NonFiniteError) as info:
        train(make, tmp_path, **kw)
    return info.value.event, info.value.bundle_path


def fire_preference(tmp_path, **kw):
    with pytest.raises(NonFiniteError) as info:
        train_preference(tmp_path, **kw)
    return info.value.event, info.value.bundle_path


def line_of(text: str) -> str:
    return source_line("llm_finetune_plain_models.py", text)


@pytest.mark.parametrize("make", ["make_llama", "make_untied_causal", "make_dropout"])
def test_healthy_runs_are_not_stopped_and_train_identically(tmp_path, make):
    """Packed documents (block-causal mask) or is_causal, tied or untied, LoRA dropout under
    checkpointed layers, padded rows whose embedding is the zero padding row: no event, and
    the recorder changes nothing the loop computes."""
    recorded = train(make, tmp_path, pad_rows=(1,))
    bare = train(make, tmp_path, pad_rows=(1,), record=False)
    for (name, a), b in zip(recorded.state_dict().items(), bare.state_dict().values()):
        assert torch.equal(a, b), name
    assert not list(tmp_path.glob("*.nan"))


def test_micro_batch_without_unmasked_tokens_is_0_over_0(tmp_path):
    """The loss normalised by each micro-batch's own token count, and the step's last
    micro-batch holds only -100 labels: the chunked sum is 0, its count 0. The hint names
    that micro-batch's labels and the accumulation's fix (the step's count)."""
    event, bundle = fire("make_llama", tmp_path, per_micro=True, ignored_micro=True)
    assert (event["step"], event["phase"], event["micro_batch"]) == (2, "loss", 1)
    report = nanreplay_json(bundle)
    origin = report["origin"]
    assert (origin["op"], origin["module"], origin["micro_batch"]) == ("aten.div", "<loss>", 1)
    assert origin["made"] == "nan" and origin["samples"] == []
    assert origin["source"] == line_of("return chunked_ce(logits, labels) / num_tokens")
    assert report["cause"] == "invalid"
    hint = report["hint"]
    assert "0/0" in hint and "clamp_min(1)" in hint
    assert "Every label of micro-batch 1 (of 2 this step accumulated) is -100" in hint
    assert "loss_args[1]" in hint and "count of targets over the whole step" in hint


def test_rmsnorm_eps_of_zero_on_a_padding_row(tmp_path):
    """``norm_eps=0.0`` and a padded row: the pad token's embedding is the zero padding row,
    ``rsqrt(mean(0^2) + 0)`` is +inf at the first layer's attention norm."""
    event, bundle = fire("make_eps_zero", tmp_path, pad_rows=(2,))
    assert (event["step"], event["phase"], event["module"]) == (0, "forward",
                                                                "layers.0.attn_norm")
    report = nanreplay_json(bundle)
    origin = report["origin"]
    assert (origin["op"], origin["module"], origin["made"]) == ("aten.rsqrt",
                                                                "layers.0.attn_norm", "+inf")
    assert origin["samples"] == [2]
    assert origin["source"] == line_of("normed = x32 * torch.rsqrt(")
    assert report["cause"] == "invalid"
    assert "eps" in report["hint"] and "is 0.0" in report["hint"]


def test_rmsnorm_sqrt_at_a_zero_row_is_a_backward_only_nan(tmp_path):
    """RMSNorm written ``x / (sqrt(mean(x^2)) + eps)``: finite forward at the padding row's
    zeros, the root's derivative 1/(2 sqrt(0)) times 0 in the backward, first at the final norm
    (the backward's order). The checkpointed layers' recomputation inside the backward is no
    second derivative: the hint says nothing of create_graph."""
    event, bundle = fire("make_sqrt_norm", tmp_path, pad_rows=(1,))
    assert (event["step"], event["phase"]) == (0, "backward")
    report = nanreplay_json(bundle)
    origin = report["origin"]
    assert (origin["phase"], origin["op"], origin["module"]) == ("backward", "SqrtBackward0",
                                                                 "norm")
    assert origin["samples"] == [1] and origin["micro_batch"] == 0
    assert origin["source"] == line_of("normed = x32 / (x32.pow(2).mean(-1, keepdim=True)")
    assert report["cause"] == "invalid"
    assert "create_graph" not in report["hint"] and "differentiates the forward" not in report["hint"]
    assert "sqrt(x + eps)" in report["hint"]


def test_hand_written_softmax_overflows_bfloat16_logits(tmp_path):
    """A bf16 model whose logits reach the hundreds and a softmax cross-entropy written as
    ``exp(s) / exp(s).sum()`` without the max subtracted: exp overflows on every sample."""
    event, bundle = fire("make_bf16", tmp_path, loss="softmax")
    assert (event["step"], event["phase"], event["module"]) == (0, "loss", "<loss>")
    report = nanreplay_json(bundle)
    origin = report["origin"]
    assert (origin["op"], origin["made"], origin["dtype"]) == ("aten.exp", "+inf", "bfloat16")
    assert origin["samples"] == [0, 1, 2, 3]
    assert origin["source"] == line_of("e = logits.exp()")
    assert report["cause"] == "overflow"
    assert "subtract the row max" in report["hint"] and "torch.softmax" in report["hint"]


def test_adamw_eps_zero_on_lora_a_whose_gradient_is_zero(tmp_path):
    """LoRA's B starts at zero, so A's first gradient is exactly 0; AdamW with eps=0 divides
    m = 0 by sqrt(v) + eps = 0 for every adapter A."""
    event, bundle = fire("make_llama", tmp_path, eps=0.0)
    assert (event["step"], event["phase"]) == (0, "optimizer")
    assert event["params"] == [f"layers.{i}.attn.{p}_proj.lora_a.weight"
                               for i in range(2) for p in "qv"]
    report = nanreplay_json(bundle, code=1)
    assert report["origin"]["param"] == "layers.0.attn.q_proj.lora_a.weight"
    assert report["cause"] == "optimizer"
    assert "eps=0" in report["hint"] and "m = v = 0" in report["hint"]


def test_healthy_dpo_over_a_frozen_reference_trains_identically(tmp_path):
    """DPO's summed log-probabilities: a pair whose chosen equals its rejected has no scored
    token, so its margin is 0 and its loss log 2, finite. No event, identical weights."""
    recorded = train_preference(tmp_path, identical=1)
    bare = train_preference(tmp_path, identical=1, record=False)
    for (name, a), b in zip(recorded.state_dict().items(), bare.state_dict().values()):
        assert torch.equal(a, b), name
    assert not list(tmp_path.glob("*.nan"))


def test_ipo_pair_whose_chosen_equals_its_rejected_has_no_scored_token(tmp_path):
    """IPO's log-probabilities averaged over the response tokens; pair 1 of the last batch is
    identical, its common prefix (the prompt) is the whole row, every label -100: the mean
    over no token is 0/0 on rows 2 and 3, which the hint names by their labels."""
    event, bundle = fire_preference(tmp_path, loss="ipo", identical=1)
    assert (event["step"], event["phase"], event["module"]) == (2, "loss", "<loss>")
    report = nanreplay_json(bundle)
    origin = report["origin"]
    assert (origin["op"], origin["made"]) == ("aten.div", "nan")
    assert origin["samples"] == [2, 3]
    assert origin["source"] == line_of("return (lp * keep).sum(-1) / keep.sum(-1)")
    assert report["cause"] == "invalid"
    hint = report["hint"]
    assert "Sample(s) 2,3 have no scored token" in hint and "(labels) is -100" in hint
    assert "special tokens" not in hint and "--try drop=2,3" in hint


def test_log_of_a_hand_written_softmax_underflows_bfloat16(tmp_path):
    """The row max subtracted (no overflow), but ``log(p)`` of the softmax rather than
    log_softmax: a label whose logit is ~100 below the row's max has p = 0 in bfloat16."""
    event, bundle = fire("make_bf16", tmp_path, loss="stable")
    assert (event["step"], event["phase"], event["module"]) == (0, "loss", "<loss>")
    report = nanreplay_json(bundle)
    origin = report["origin"]
    assert (origin["op"], origin["made"], origin["dtype"]) == ("aten.log", "-inf", "bfloat16")
    assert origin["samples"] == [0, 1, 2, 3]
    assert origin["source"] == line_of("logp = p.gather(-1, labels.clamp_min(0)[..., None])[..., 0].log()")
    assert report["cause"] == "underflow"
    assert "log_softmax instead of log(softmax)" in report["hint"]


def test_sqrt_rmsnorm_inside_checkpointed_layers_is_named_at_the_layer(tmp_path):
    """The sqrt RMSNorm only in the layers, each under checkpoint(use_reentrant=False): the
    first backward NaN is the last layer's MLP norm, a node the recomputation made inside the
    backward; named at its module and line, with no create_graph hint."""
    event, bundle = fire("make_sqrt_norm_in_layers", tmp_path, pad_rows=(1,))
    assert (event["step"], event["phase"]) == (0, "backward")
    report = nanreplay_json(bundle)
    origin = report["origin"]
    assert (origin["op"], origin["module"]) == ("SqrtBackward0", "layers.1.mlp_norm")
    assert origin["samples"] == [1]
    assert origin["source"] == line_of("normed = x32 / (x32.pow(2).mean(-1, keepdim=True)")
    assert report["cause"] == "invalid"
    assert "create_graph" not in report["hint"] and "add an eps" in report["hint"]


def test_rope_base_zero_is_a_cached_table_the_factory_builds_nan(tmp_path):
    """``rope_base=0``: ``1 / 0 ** (2i/d)`` is inf past i = 0, position 0's angle 0 * inf;
    the table indexed by the position ids (``cache[pos]``) carries it into q and k."""
    event, bundle = fire("make_rope_base_zero", tmp_path)
    assert (event["step"], event["phase"], event["module"]) == (0, "forward", "layers.0.attn")
    report = nanreplay_json(bundle)
    origin = report["origin"]
    assert (origin["phase"], origin["param"], origin["op"]) == ("weights", "layers.0.attn.rope",
                                                                "aten.index")
    assert origin["source"] == line_of("rope = cache[pos][:, None]")
    assert report["cause"] == "weights"
    assert "the factory builds" in report["hint"]
