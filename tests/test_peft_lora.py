"""End to end: LoRA fine-tuning with the real PEFT library (``peft_lora_models``: a tiny
Llama from a config wrapped by ``get_peft_model(LoraConfig(...))``, base frozen, adapters
trained by AdamW) under the flight recorder until a planted bug of the domain fires, replayed
with the CLI: the replay rebuilds the PEFT-wrapped model through the factory and names modules
and parameters by their PEFT names (``base_model.model...lora_A.default``)."""

from __future__ import annotations

import pytest

pytest.importorskip("peft")

import peft_lora_models as M  # noqa: E402
import torch  # noqa: E402
from bundles import nanreplay_json, source_line  # noqa: E402

from recorder import FlightRecorder, NonFiniteError  # noqa: E402

# (transformers 5 warns that PEFT reads its deprecated is_gradient_checkpointing)
pytestmark = [pytest.mark.usefixtures("in_tests_dir"),
              pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing`:FutureWarning")]

LAYER0 = "base_model.model.model.layers.0.self_attn"


def train(tmp_path, loss_fn, data, steps=8, lr=1e-3, eps=1e-8, record=True, inner_loss=False,
          clip=None, **fkw):
    """The plain loop over ``data``: the adapters' AdamW, the response-only loss; with
    ``inner_loss`` the model's own (``model(..., labels=...).loss``)."""
    model = M.make_llama_lora(**fkw)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, eps=eps)
    rec = FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=tmp_path / "b",
                         factory="peft_lora_models:make_llama_lora",
                         factory_kwargs=fkw) if record else None
    with rec or torch.enable_grad():
        for i, b in enumerate(data):
            if i >= steps:
                break
            opt.zero_grad()
            if inner_loss:
                loss = model(**b).loss
            else:
                out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"])
                loss = loss_fn(out.logits, b["labels"])
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(params, clip)
            opt.step()
    return model


def fire(tmp_path, *a, **kw):
    with pytest.raises(NonFiniteError) as info:
        train(tmp_path, *a, **kw)
    return nanreplay_json(info.value.bundle_path, "--json", code=None)


def origin(rep):
    o = rep["origin"]
    return o["phase"], o["module"], o["op"], rep["event"]["step"], rep["cause"]


def test_healthy_run_raises_nothing_and_trains_identically(tmp_path):
    """Frozen base, LoRA on q/v with dropout, clipping: no event, the same adapters bit for bit
    with and without the recorder, and merge_and_unload leaves a finite plain Llama."""
    runs = [train(tmp_path / str(r), M.LmLoss(), M.loader(24), steps=6, clip=1.0, record=r)
            for r in (False, True)]
    a, b = (dict(m.named_parameters()) for m in runs)
    assert [n for n, p in a.items() if p.requires_grad] == [
        f"base_model.model.model.layers.{i}.self_attn.{w}_proj.lora_{ab}.default.weight"
        for i in range(2) for w in "qv" for ab in "AB"]
    assert all(torch.equal(a[n], b[n]) for n in a)
    merged = runs[1].merge_and_unload()
    assert all(torch.isfinite(p).all() for p in merged.parameters())
    assert not list((tmp_path / "True" / "b").glob("*.nan"))


def test_lora_alpha_over_r_overflows_the_float16_base(tmp_path):
    """lora_alpha 2**21 at r=4 (a scaling of 524288) on a float16 base: the float32 adapter's
    output, cast back to float16 in q_proj, grows each step until the rotary embedding's add
    passes float16's maximum at step 5; the precursors name q_proj drifting there."""
    rep = fire(tmp_path, M.LmLoss(), M.loader(32), lr=1e-2, alpha=2.0 ** 21, dtype="float16")
    assert origin(rep) == ("forward", LAYER0, "aten.add", 5, "overflow")
    assert (f"But no batch of this step made the values: {LAYER0}.q_proj's output was already "
            "past half the float16 maximum at step 2") in rep["hint"]
    assert f"({LAYER0}.q_proj.lora_A.default.weight, {LAYER0}.q_proj.lora_B.default.weight)" \
        in rep["hint"]
    assert rep["origin"]["samples"] == [0, 1, 2]
    assert {"step": 2, "kind": "near_fp16_max",
            "detail": f"absmax of {LAYER0}.q_proj is 3.366e+04, past half the float16 maximum "
                      "65504"} in rep["precursors"]


def test_a_truncated_prompt_leaves_a_sequence_no_response_token(tmp_path):
    """Sample 9 (step 2, row 1): its prompt fills the window, every label is -100, and the
    per-sequence mean divides 0 by 0."""
    rep = fire(tmp_path, M.PerSequenceLoss(), M.loader(32, long_prompt=(9,)))
    assert origin(rep) == ("loss", "<loss>", "aten.div", 2, "invalid")
    assert rep["origin"]["samples"] == [1]
    assert rep["origin"]["source"] == source_line("peft_lora_models.py", "per_seq = (tok")
    assert "count.clamp(min=1)" in rep["hint"]


def test_a_batch_with_every_label_masked(tmp_path):
    """Step 1's batch holds only truncated prompts: the model's own mean cross-entropy over no
    token is 0/0."""
    rep = fire(tmp_path, None, M.loader(32, long_prompt=(4, 5, 6, 7)), inner_loss=True)
    assert origin(rep) == ("forward", "base_model.model", "aten.nll_loss_forward", 1, "invalid")
    assert "every target of the batch is ignore_index (-100)" in rep["hint"]
    assert "truncate the prompt, not the answer" in rep["hint"]


def test_a_corrupted_embedding_row_in_the_frozen_base(tmp_path):
    """The base checkpoint's row for token 63 is NaN; the frozen base is never updated, and
    the first batch holding that token (step 2, row 2) reads it: the factory's weights, not the
    optimizer's."""
    rep = fire(tmp_path, M.LmLoss(), M.loader(32, rare=(10,)), corrupt_row=M.RARE)
    emb = "base_model.model.model.embed_tokens"
    assert origin(rep) == ("weights", emb, "aten.embedding", 2, "weights")
    assert rep["origin"]["rows"] == [M.RARE]
    assert rep["origin"]["param"] == f"{emb}.weight"
    assert rep["origin"]["samples"] == [2]
    assert rep["hint"].startswith(f"the factory builds {emb}.weight NaN")
    assert "step 2 is only the first whose forward read those entries" in rep["hint"]
    assert "EMA" not in rep["hint"]


def test_adam_eps_zero_makes_lora_a_nan(tmp_path):
    """AdamW(eps=0): lora_B starts at 0, so lora_A's first gradient is exactly 0 and its
    update m / sqrt(v) is 0/0 (all four lora_A matrices, at step 0)."""
    rep = fire(tmp_path, M.LmLoss(), M.loader(32), eps=0.0)
    assert origin(rep)[3:] == (0, "optimizer")
    assert rep["event"]["params"] == [
        f"base_model.model.model.layers.{i}.self_attn.{w}_proj.lora_A.default.weight"
        for i in range(2) for w in "qv"]
    assert "eps=0" in rep["hint"]


def test_a_norm_penalty_on_a_zero_initialised_saved_head(tmp_path):
    """GPT-2 classifier, LoRA on c_attn, the new ``score`` head trained in full
    (``modules_to_save``) and zero-initialised: every logit is 0 at step 0, and the penalty's
    hand-written norm sqrt(sum(z**2)) has an infinite gradient there (backward only)."""
    model = M.make_gpt2_cls(zero_head=True)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    loss_fn = M.LogitPenaltyCE()
    head = "base_model.model.score.modules_to_save.default.weight"
    assert params[-1] is dict(model.named_parameters())[head]
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=tmp_path / "b",
                            factory="peft_lora_models:make_gpt2_cls",
                            factory_kwargs={"zero_head": True}):
            for b in torch.utils.data.DataLoader(M.classification_rows(16), batch_size=4):
                opt.zero_grad()
                out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"])
                loss_fn(out.logits, b["labels"]).backward()
                opt.step()
    rep = nanreplay_json(info.value.bundle_path, "--json", code=None)
    assert origin(rep) == ("backward", "<loss>", "SqrtBackward0", 0, "invalid")
    assert rep["origin"]["samples"] == [0, 1, 2, 3]
    assert rep["origin"]["source"] == source_line("peft_lora_models.py", "norm = logits")
    assert (f"parameter {head} is all 0 as the step began: that layer outputs 0 for every "
            "input") in rep["hint"]
