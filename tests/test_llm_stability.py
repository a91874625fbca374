"""End to end on a small LLM pretraining loop with the stability tricks of the domain
(``llm_stability_models``): tied embeddings, QK-norm, RoPE or ALiBi, a final-logit soft-cap,
z-loss, packed documents under a block-diagonal causal mask, AdamW with a warmup-stable-decay
schedule, global-norm clipping, gradient accumulation and fp16 autocast with a GradScaler.
Each planted bug fires under the recorder and is replayed with the CLI; the healthy runs raise
no event and train bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import llm_stability_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

STEPS = 4


def wsd(step: int, warmup: int = 2, stable: int = 1, decay: int = 2) -> float:
    """Warmup-stable-decay (MiniCPM, OLMo 2): linear warmup, flat, linear decay to 10%."""
    if step < warmup:
        return (step + 1) / warmup
    if step < warmup + stable:
        return 1.0
    return max(0.1, 1.0 - 0.9 * (step - warmup - stable + 1) / decay)


def train(make: str, out_dir, short_row: int | None = None, fp16: bool = False,
          record: bool = True, accum: int = 2, all_padding: bool = False,
          init_scale: float = 2.0 ** 16):
    """nanoGPT's loop: ``accum`` micro-batches per step, fp16 autocast with a GradScaler when
    asked, unscale then clip the global norm at 1.0, AdamW with weight decay only on matrices.
    ``short_row`` plants a short, padded row in the last step's last micro-batch."""
    model = getattr(M, make)()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=3e-3, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, wsd)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, enabled=fp16)
    g = torch.Generator().manual_seed(0)
    rec = FlightRecorder(model, opt, loss_fn=M.lm_loss, out_dir=out_dir, scaler=scaler,
                        lr_scheduler=sched,
                         factory=f"llm_stability_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else M.lm_loss
        for step in range(STEPS):
            for micro in range(accum):
                last = step == STEPS - 1 and micro == accum - 1
                tokens, doc_ids, targets = M.packed_batch(g, short_row=short_row if last else None,
                                                           all_padding=all_padding and last)
                with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
                    logits = model(tokens, doc_ids)
                    loss = loss_fn(logits, targets) / accum
                scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            sched.step()
    return model


def fire(make: str, tmp_path, **kw):
    with pytest.raises(NonFiniteError) as info:
        train(make, tmp_path, **kw)
    return info.value.event, info.value.bundle_path


def line_of(text: str) -> str:
    return source_line("llm_stability_models.py", text)


def test_padded_query_without_a_key_is_an_all_masked_softmax_row(tmp_path):
    """The key-padding mask without the diagonal: the epoch's last, short pack (row 2 of the
    last micro-batch) has padding queries with no key left; their softmax row is all -inf."""
    event, bundle = fire("make_key_padding_mask", tmp_path, short_row=2)
    assert (event["step"], event["phase"], event["module"]) == (3, "forward", "blocks.0.attn")
    report = nanreplay_json(bundle)
    origin = report["origin"]
    assert (origin["op"], origin["module"], origin["micro_batch"]) == ("aten._softmax",
                                                                      "blocks.0.attn", 1)
    assert origin["samples"] == [2]
    assert origin["source"] == line_of("att = F.softmax(scores, dim=-1)")
    assert report["cause"] == "invalid"
    assert "fully masked row" in report["hint"] and "at least one key per row" in report["hint"]
    # the mask's own -inf is the intended fill, not the origin
    assert origin["chain"][0]["intentional"] is True


def test_soft_cap_of_zero_names_the_division_by_the_cap(tmp_path):
    """``final_logit_softcapping = 0.0`` meant as "off": the forward hides it (0 * tanh(+-inf)
    is 0, the loss is log V), the backward divides by 0 at the soft-cap's line."""
    event, bundle = fire("make_softcap_zero", tmp_path)
    assert (event["step"], event["phase"]) == (0, "backward")
    report = nanreplay_json(bundle)
    origin = report["origin"]
    assert (origin["phase"], origin["op"]) == ("backward", "DivBackward0")
    assert origin["source"] == line_of("logits = cap * torch.tanh(logits / cap)")
    assert report["cause"] == "invalid"
    assert "soft-cap" in report["hint"] and "if cap:" in report["hint"]


# the scaler skips the step with inf gradients, so the scheduler steps before any update
@pytest.mark.filterwarnings("ignore:Detected call of:UserWarning")
def test_z_loss_squared_logsumexp_overflows_float16(tmp_path):
    """muP's output multiplier inverted, no soft-cap, fp16 autocast: the logits reach hundreds,
    the z-loss's ``logsumexp ** 2`` passes 65504 in float16 while the model's output is finite."""
    event, bundle = fire("make_mup_fp16", tmp_path, fp16=True)
    assert (event["step"], event["phase"], event["module"]) == (0, "loss", "<loss>")
    report = nanreplay_json(bundle)
    origin = report["origin"]
    assert (origin["op"], origin["dtype"], origin["made"]) == ("aten.pow", "float16", "+inf")
    # every sample's tokens overflow (the multiplier's bug), read through flat[valid]
    assert origin["samples"] == [0, 1, 2, 3] and origin["all_samples"] is True
    assert origin["source"] == line_of("return ce + z_weight * z.pow(2).mean()")
    assert report["cause"] == "overflow"
    assert "float32" in report["hint"] and "autocast" in report["hint"]


@pytest.mark.parametrize(("make", "fp16"), [("make_gpt", False), ("make_gpt", True),
                                            ("make_alibi", False)])
def test_healthy_runs_with_short_packs_are_not_stopped_and_train_identically(tmp_path, make,
                                                                            fp16):
    """-inf fills of the block-diagonal causal mask stay inside the softmax; a short pack whose
    padding attends itself is finite; the recorder changes nothing the loop computes."""
    recorded = train(make, tmp_path, short_row=1, fp16=fp16)
    bare = train(make, tmp_path, short_row=1, fp16=fp16, record=False)
    for (name, a), b in zip(recorded.state_dict().items(), bare.state_dict().values()):
        assert torch.equal(a, b), name
    assert not list(tmp_path.glob("*.nan"))


def test_tokens_a_mask_picked_from_flattened_logits_are_named_by_their_sample():
    """``logits.reshape(-1, V)[targets.view(-1) != -100]``: row r of the flat logits is sample
    r // T, and the mask's picks keep that (one sample's token overflows the z-loss)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from replay.reordered import Reordered

    class Watch(TorchDispatchMode):
        def __init__(self, tracker):
            super().__init__()
            self.tracker = tracker

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.tracker.track(func.overloadpacket.__name__, args,
                               tree_leaves((args, kwargs)), out)
            return out

    B, T, V = 3, 4, 5
    logits = torch.zeros(B, T, V, dtype=torch.float16)
    logits[2, 1] = 300.0  # logsumexp 300, its square past float16's 65504
    targets = torch.ones(B, T, dtype=torch.long)
    targets[0, :2] = -100  # padding: the picked rows are not the flat rows
    tracker = Reordered(B)
    with Watch(tracker):
        flat = logits.reshape(-1, V)
        z = torch.logsumexp(flat[targets.reshape(-1) != -100], dim=-1).pow(2)
    assert z.isinf().nonzero().flatten().tolist() == [7]  # (flat row 9)
    assert tracker.picked_rows([z]) == [2]


def test_rope_theta_of_zero_is_a_buffer_the_factory_builds_nan(tmp_path):
    """``rope_theta`` defaulting to 0: the cos/sin tables are NaN from ``__init__``; the
    report blames the buffers as the factory builds them, not the data or the update."""
    event, bundle = fire("make_rope_theta_unset", tmp_path)
    assert (event["step"], event["phase"], event["module"]) == (0, "forward", "blocks.0.attn")
    report = nanreplay_json(bundle)
    origin = report["origin"]
    assert origin["phase"] == "weights" and origin["param"] == "blocks.0.attn.cos"
    assert origin["op"] == "aten.mul"
    assert origin["source"] == line_of("return torch.stack((x1 * cos - x2 * sin")
    assert report["cause"] == "weights"
    # named by the op that made the table's infinity, which cos/sin then turned into NaN
    assert "the factory builds" in report["hint"]
    assert "aten.reciprocal of 0 made +inf at " + line_of("inv_freq = 1.0 / base **") \
        in report["hint"]


def test_all_padding_micro_batch_is_cross_entropy_over_no_target(tmp_path):
    """Gradient accumulation's last micro-batch past the epoch's end, every target -100: the
    model's output is finite, the mean cross-entropy is 0/0."""
    event, bundle = fire("make_gpt", tmp_path, all_padding=True)
    assert (event["step"], event["phase"], event["micro_batch"]) == (3, "loss", 1)
    report = nanreplay_json(bundle)
    origin = report["origin"]
    assert (origin["op"], origin["made"]) == ("aten.nll_loss_forward", "nan")
    assert origin["source"] == line_of("ce = F.cross_entropy(flat, targets.reshape(-1)")
    assert report["cause"] == "invalid"
    assert "ignore_index" in report["hint"] and "max(count, 1)" in report["hint"]


@pytest.mark.filterwarnings("ignore:Detected call of:UserWarning")
def test_attention_logits_without_qk_norm_overflow_float16(tmp_path):
    """No QK-layernorm and a grown pre-attention gain under fp16 autocast: ``q @ k^T``
    overflows, then the softmax of +inf makes the NaN the recorder sees."""
    event, bundle = fire("make_no_qknorm_grown", tmp_path, fp16=True)
    assert (event["step"], event["phase"], event["module"]) == (0, "forward", "blocks.0.attn")
    report = nanreplay_json(bundle)
    origin = report["origin"]
    assert (origin["op"], origin["made"], origin["dtype"]) == ("aten.bmm", "+inf", "float16")
    assert origin["source"] == line_of("scores = (q @ k.transpose(-2, -1)) * scale")
    assert [c["op"] for c in origin["chain"]] == ["aten.bmm", "aten._softmax"]
    assert report["cause"] == "overflow"
    assert "float32" in report["hint"] and "rescale its inputs" in report["hint"]


@pytest.mark.filterwarnings("ignore:Detected call of:UserWarning")
def test_steps_the_grad_scaler_skips_after_clipping_inf_are_not_events(tmp_path):
    """A too-large initial loss scale: every step's fp16 gradients overflow, ``unscale_`` then
    ``clip_grad_norm_`` turn them into NaN (an inf total norm), and the scaler skips the update.
    Not an event; nothing trains, with or without the recorder."""
    recorded = train("make_gpt", tmp_path, fp16=True, init_scale=2.0 ** 60)
    bare = train("make_gpt", tmp_path, fp16=True, init_scale=2.0 ** 60, record=False)
    start = M.make_gpt()
    for (name, a), b, c in zip(recorded.state_dict().items(), bare.state_dict().values(),
                               start.state_dict().values()):
        assert torch.equal(a, b) and torch.equal(a, c), name
    assert not list(tmp_path.glob("*.nan"))
