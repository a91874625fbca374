"""End to end: the efficient-attention variants of ``efficient_attention_models`` (Performer's
random features, fast-transformers' causal linear attention, RoPE under autocast, ALiBi with a
sliding window, FlashAttention's online softmax in PyTorch), each trained as an LM is (a
DataLoader of left-padded rows with their mask and position ids, AdamW with a warmup schedule,
two accumulated micro-batches a step) under the recorder until a planted bug fires, then
replayed with the CLI; and the same models without the bug, which must run clean."""

from __future__ import annotations

import efficient_attention_models as M
import pytest
import torch
from bundles import line_number, nanreplay_json

from recorder import FlightRecorder, NonFiniteError

PADS = [0, 2, 0, 5, 0, 1]  # rows 1, 3, 5 left-padded
PADDED = [i for i, p in enumerate(PADS) if p]


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> int:
    return line_number("efficient_attention_models.py", text)


def train(out_dir, factory: str, pads_at: dict, steps: int = 3, accum: int = 2,
          autocast: torch.dtype | None = None, offset: int = 0):
    """AdamW with a linear warmup, ``accum`` micro-batches a step; the NonFiniteError, or None
    when the run finished clean."""
    model = getattr(M, factory)()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    loader = torch.utils.data.DataLoader(M.LeftPadded(pads_at, offset=offset), M.BATCH)
    batches = iter(loader)
    try:
        with FlightRecorder(model, opt, loss_fn=M.lm_loss, out_dir=out_dir,
                            factory=f"efficient_attention_models:{factory}") as rec:
            for _ in range(steps):
                opt.zero_grad()
                for _ in range(accum):
                    ids, am, pos = next(batches)
                    with torch.autocast("cpu", dtype=autocast or torch.bfloat16,
                                        enabled=autocast is not None):
                        logits = model(ids, am, pos)
                    (rec.loss_fn(logits, ids, am) / accum).backward()
                opt.step()
                sched.step()
    except NonFiniteError as e:
        return e
    return None


def origin_of(err, step: int, phase: str = "forward") -> tuple[dict, dict]:
    assert (err.event["step"], err.event["phase"]) == (step, phase), err.event
    rep = nanreplay_json(err.bundle_path)
    assert rep["reproduced"] is True, rep
    return rep, rep["origin"]


def test_performer_relu_features_without_kernel_epsilon_name_the_eps_before_the_product(tmp_path):
    # generalized_kernel's relu(w.x) + 0: a query whose positive features no key so far shares
    # gets q . k_cumsum = 0, and D_inv = 1 / 0 times a context of 0 is NaN
    err = train(tmp_path, "make_performer_relu_no_eps", {})
    rep, o = origin_of(err, 0)
    assert (rep["cause"], o["module"], o["op"], o["made"], o["micro_batch"]) == (
        "invalid", "block.attn", "aten.reciprocal", "+inf", 0), rep
    assert o["source"] == f"efficient_attention_models.py:{line_of('D_inv = 1.0 /')}"
    assert o["samples"] == err.event["samples"] and o["samples"], rep
    # (was: "add an eps to the denominator", silent on the kernel_epsilon of 0 already there)
    assert "the eps added to the values that input is a sum of products of" in rep["hint"], \
        rep["hint"]
    assert "is exactly 0 (an eps option set to 0" in rep["hint"], rep["hint"]


def test_performer_relu_kernel_epsilon_lost_in_float16_asks_for_one_whose_square_it_keeps(
        tmp_path):
    # kernel_epsilon = 1e-8 under float16 autocast is 0 in each feature; what would keep
    # q . k_cumsum off 0 is eps squared, so float16's smallest normal number is not enough
    err = train(tmp_path, "make_performer_relu_eps_1e8", {}, autocast=torch.float16)
    rep, o = origin_of(err, 0)
    assert (rep["cause"], o["module"], o["op"], o["made"]) == (
        "underflow", "block.attn", "aten.reciprocal", "+inf"), rep
    assert o["samples"] == err.event["samples"] and o["samples"], rep
    assert "the eps 1e-08 added to the values that input is a sum of products of" in \
        rep["hint"], rep["hint"]
    assert "at least 0.00781 (the square root of float16's smallest normal" in rep["hint"], \
        rep["hint"]


def test_linear_attention_without_eps_in_an_accumulated_micro_batch(tmp_path):
    # fast-transformers' Z = 1 / (Q . K.cumsum + eps) with eps = 0: a left-padded row's first
    # queries have only padded (zeroed) keys so far; the padding comes in step 2's second
    # micro-batch
    err = train(tmp_path, "make_linear_no_eps", {5: PADS})
    rep, o = origin_of(err, 2)
    assert (rep["cause"], o["module"], o["op"], o["made"], o["micro_batch"], o["samples"]) == (
        "invalid", "block.attn", "aten.reciprocal", "+inf", 1, PADDED), rep
    assert o["source"] == f"efficient_attention_models.py:{line_of('Z = 1 / (torch.einsum')}"
    assert "the eps added to that input is exactly 0" in rep["hint"], rep["hint"]


def test_linear_attention_over_heads_folded_into_the_batch_names_the_samples(tmp_path):
    # fairseq's (b * h, t, d) layout: the rows of the divisor are sample-head pairs, and the
    # report names the samples they belong to, not the flattened rows
    err = train(tmp_path, "make_flat_linear_no_eps", {1: PADS})
    rep, o = origin_of(err, 0)
    assert (rep["cause"], o["module"], o["op"], o["micro_batch"], o["samples"]) == (
        "invalid", "block.attn", "aten.reciprocal", 1, PADDED), rep
    divisor = line_of('"nli,nli->nl", Q, K.cumsum(1)) + self.eps')
    assert o["source"] == f"efficient_attention_models.py:{divisor}", rep


def test_linear_attention_where_guard_is_a_backward_pole(tmp_path):
    # torch.where(den > 0, 1 / den, 0): the forward is finite, reciprocal's backward is not
    err = train(tmp_path, "make_linear_where", {0: PADS})
    rep, o = origin_of(err, 0, "backward")
    assert (rep["cause"], o["module"], o["op"], o["samples"]) == (
        "invalid", "block.attn", "ReciprocalBackward0", PADDED), rep
    assert o["source"] == f"efficient_attention_models.py:{line_of('Z = torch.where(den > 0')}"
    assert "torch.where(mask, x, 1)" in rep["hint"], rep["hint"]


def test_rope_frequencies_left_in_float16_autocast_overflow_at_long_positions(tmp_path):
    # HF's rotary embedding disables autocast for inv_freq @ position_ids; left on, float16
    # holds no position past 65504 (a chunk 70000 tokens into a document), cos(inf) is NaN
    err = train(tmp_path, "make_rotary_autocast", {}, autocast=torch.float16, offset=70_000)
    rep, o = origin_of(err, 0)
    assert (rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        "overflow", "block.attn.rotary_emb", "aten._to_copy", "+inf", list(range(M.BATCH))), rep
    assert o["source"] == f"efficient_attention_models.py:{line_of('freqs = (inv_freq_expanded')}"
    assert "float16's largest value" in rep["hint"] and "outside autocast" in rep["hint"], \
        rep["hint"]


@pytest.mark.parametrize(("factory", "pads_at", "step", "samples"), [
    ("make_performer", {}, 0, [2]), ("make_performer_relu", {2: PADS}, 1, PADDED)])
def test_performer_normaliser_in_float16_autocast_asks_for_float32(tmp_path, factory, pads_at,
                                                                   step, samples):
    # D_inv = 1 / (q . k_cumsum) left in float16 autocast (performer-pytorch turns autocast off
    # around it): the normaliser is tiny and positive, 1 / D ** 2 in the backward leaves
    # float16's range, not float32's
    err = train(tmp_path, factory, pads_at, autocast=torch.float16)
    rep, o = origin_of(err, step, "backward")
    assert (rep["cause"], o["module"], o["op"], o["samples"]) == (
        "overflow", "block.attn", "ReciprocalBackward0", samples), rep
    assert o["source"] == f"efficient_attention_models.py:{line_of('D_inv = 1.0 /')}"
    # (was: only log space, a clamp or float64: float32 outside autocast is the fix)
    assert "the gradient left float16's range, not float32's: first compute this op in " \
        "float32 (outside autocast" in rep["hint"], rep["hint"]
    # (was: "made by exp, softmax, sigmoid or softplus" of ReLU features too)
    assert "linear attention's phi(q) . sum phi(k)" in rep["hint"], rep["hint"]


def test_cosine_attention_normalize_eps_lost_in_float16_autocast(tmp_path):
    # Swin V2's F.normalize(q) under CPU float16 autocast: a pad token's query is 0, its norm 0,
    # and normalize's clamp_min(1e-12) is 0 in float16: 0 / 0
    err = train(tmp_path, "make_cosine", {0: PADS}, autocast=torch.float16)
    rep, o = origin_of(err, 0)
    assert (rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        "underflow", "block.attn", "aten.div", "nan", PADDED), rep
    assert o["source"] == f"efficient_attention_models.py:{line_of('F.normalize(q, dim=-1) @')}"
    # (was: silent on the eps: normalize divides by norm.clamp_min(eps).expand_as(x), a view)
    assert "the eps 1e-12 added to that input is 0 in float16" in rep["hint"], rep["hint"]
    assert "compute this in float32" in rep["hint"], rep["hint"]


def test_alibi_sliding_window_over_left_padding_is_a_fully_masked_row(tmp_path):
    # the window of a pad query holds only pads: every score -inf, softmax NaN
    err = train(tmp_path, "make_alibi", {0: PADS})
    rep, o = origin_of(err, 0)
    assert (rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        "invalid", "block.attn", "aten._softmax", "nan", PADDED), rep
    assert o["source"] == f"efficient_attention_models.py:{line_of('return self.out(s.softmax')}"
    assert "fully masked row" in rep["hint"], rep["hint"]


def test_online_softmax_without_the_running_max_guard(tmp_path):
    # FlashAttention's m starts at -inf; a block of keys all padding leaves it -inf, and
    # exp(s - m) is exp(-inf - -inf)
    err = train(tmp_path, "make_online_unguarded", {0: PADS})
    rep, o = origin_of(err, 0)
    assert (rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        "invalid", "block.attn", "aten.amax", "-inf", PADDED), rep
    assert o["source"] == f"efficient_attention_models.py:{line_of('m_new = torch.maximum(')}"
    # (was: only a CRF's logsumexp, beside "keep at least one key per row", which row 3's
    # later queries have: only its first block of keys is all padding)
    assert "running max of an online softmax over blocks of keys" in rep["hint"], rep["hint"]
    assert "replace an infinite m by 0 before the shift (torch.where(m == -inf, 0, m))" in \
        rep["hint"], rep["hint"]


@pytest.mark.parametrize(("factory", "autocast", "offset"), [
    ("make_performer", None, 0), ("make_performer_relu", None, 0), ("make_linear", None, 0),
    ("make_cosine", None, 0), ("make_online", None, 0),
    ("make_rotary", torch.float16, 70_000), ("make_rotary", torch.bfloat16, 70_000),
    ("make_performer", torch.bfloat16, 0), ("make_linear", torch.bfloat16, 0),
    ("make_online", torch.bfloat16, 0)])
def test_healthy_variants_run_clean(tmp_path, factory, autocast, offset):
    # the same padding, positions and autocast with the repositories' own guards: no event
    assert train(tmp_path, factory, {0: PADS, 3: PADS}, autocast=autocast, offset=offset) is None
