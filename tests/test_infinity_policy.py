"""Infinities: by default only the ones that matter are events (issue 11, item 1).

A NaN anywhere is an event. A +-Inf is one when it reaches the root output, the loss, a gradient
or a weight, or turns into a NaN; a +-Inf that stays inside the model (a float -inf mask passed
into forward, masked attention scores, a mask made by the model) is recorded in the ring buffer
and is no event. The replay still names the op that first made the infinity: a float16 overflow
that a later layer turns into NaN is blamed on the overflowing op. ``strict_inf=True`` makes
every +-Inf an event again, with ``allow_inf`` exempting names (root inputs included).

Planted bugs train real loops and replay the bundle with ``nanreplay BUNDLE --json``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import infinity_models as I
import pytest
import torch
from bundles import nanreplay_json, source_line
from click.testing import CliRunner
from models import bundles, check_event
from test_recorder_sync import FLIGHT, count_host_reads
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from recorder.bundle import read_bundle
from recorder.huggingface import FlightRecorderCallback
from replay.cli import main as cli

HERE = Path(__file__).parent
K = 3


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def _lm_loop(model, rec_kwargs, out_dir, steps=4, pad=False):
    """The tutorial loop: ``model(src, src_mask)`` with the square subsequent mask."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = nn.CrossEntropyLoss()
    mask = nn.Transformer.generate_square_subsequent_mask(I.CTX)
    assert torch.isneginf(mask).any()
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                        factory="infinity_models:make_tutorial_lm", **rec_kwargs) as rec:
        for step in range(steps):
            src, tgt = I.token_batch(step)
            kw = {}
            if pad:  # the last two positions of row 0 are padding (a float mask, as src_mask)
                kpm = torch.zeros(I.BATCH, I.CTX)
                kpm[0, -2:] = -math.inf
                kw["src_key_padding_mask"] = kpm
            opt.zero_grad()
            out = model(src, src_mask=mask, **kw)
            crit(out.reshape(-1, I.VOCAB), tgt.reshape(-1)).backward()
            opt.step()
    return rec


# ---------------------------------------------------------------------------------------------
# infinities that stay inside: no event, but in the ring buffer


@pytest.mark.parametrize("pad", [False, True])
def test_tutorial_transformer_with_float_inf_mask_trains_without_event(out_dir, pad):
    rec = _lm_loop(I.TutorialLM(), {}, out_dir, pad=pad)
    assert rec.event is None and rec.step == 4 and bundles(out_dir) == []


def test_tutorial_mask_is_an_input_event_with_strict_inf(out_dir):
    with pytest.raises(NonFiniteError) as info:
        _lm_loop(I.TutorialLM(), {"strict_inf": True}, out_dir)
    check_event(info.value.event, step=0, phase="input", module="",
                tensor='kwargs["src_mask"]', kind="-inf")


@pytest.mark.parametrize("pattern", ["src_mask", "src_*"])
def test_strict_inf_allow_inf_exempts_a_root_input_by_name(out_dir, pattern):
    rec = _lm_loop(I.TutorialLM(), {"strict_inf": True, "allow_inf": [pattern]}, out_dir)
    assert rec.event is None and rec.step == 4


def test_one_host_read_per_step_with_masks_inside(out_dir):
    model = I.TutorialLM()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    crit = nn.CrossEntropyLoss()
    mask = nn.Transformer.generate_square_subsequent_mask(I.CTX)
    per_step = []
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir) as rec:
        with count_host_reads() as calls:
            for step in range(4):
                seen = len(calls)
                src, tgt = I.token_batch(step)
                opt.zero_grad()
                crit(model(src, mask).reshape(-1, I.VOCAB), tgt.reshape(-1)).backward()
                opt.step()
                # (nn.TransformerEncoder reads the mask on the host itself: not counted)
                per_step.append([c for c in calls[seen:] if c[1] == FLIGHT])
    assert [len(c) for c in per_step] == [1] * 4, per_step
    assert rec.event is None


def test_inner_inf_is_recorded_in_the_ring_buffer(out_dir):
    model = I.MaskThenLog()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    crit = nn.CrossEntropyLoss()
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir) as rec:
        for _ in range(3):
            x, y = torch.rand(16, I.D_IN), torch.randint(0, I.N_CLASSES, (16,))
            opt.zero_grad()
            crit(model(x), y).backward()
            opt.step()
        assert rec.event is None
        _, ring = rec.cycle.ring.export(len(rec.target.params), 1)
        fields = ["min", "max", "absmax", "mean", "rms", "nan", "posinf", "neginf"]
        mask = rec.target.module_names.index("mask")
        calls = ring["ring/calls"][ring["ring/call_module"] == mask]
        assert calls.shape[0] == 3  # one call per step, each with its -inf
        assert (calls[:, fields.index("neginf")] == 1).all()
        assert (calls[:, fields.index("min")] == -math.inf).all()
        assert (calls[:, fields.index("nan")] == 0).all()


# ---------------------------------------------------------------------------------------------
# infinities that matter: events, with the chain


def _train(factory, make_batch, out_dir, steps=6, **rec_kwargs):
    model = getattr(I, factory)()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory=f"infinity_models:{factory}", **rec_kwargs):
            for step in range(steps):
                x, y = make_batch(step)
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    return info.value


def _big_row(row, value):
    def make(step):
        x, y = I.batch(step)
        if step == K:
            x[row] = value  # finite in float16 (max 65504); the float16 layer's output is not
        return x, y
    return make


def test_float16_overflow_turned_into_nan_is_blamed_on_the_overflow(out_dir):
    err = _train("make_half_then_norm", _big_row(5, 6e4), out_dir)
    # the NaN is LayerNorm's (inf - inf), the chain starts at the float16 layer's +-inf
    check_event(err.event, step=K, phase="forward", module="half_lin", call=0,
                inputs_finite=True)
    assert err.event["kind"] in ("+inf", "-inf")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"]) == \
        ("forward", "half_lin", "aten.addmm", [5]), o
    assert rep["cause"] == "overflow" and rep["reproduced"] is True
    assert [c["op"] for c in o["chain"]][0] == "aten.addmm"
    assert rep["bisection"]["agrees"] is True


def test_float16_overflow_in_an_attention_given_the_causal_mask_names_its_projection(out_dir):
    """The tutorial's ``nn.TransformerEncoder`` under float16 autocast, its causal mask (-inf
    above the diagonal) handed to each layer's ``self_attn`` as ``attn_mask``. At step 3 the
    second layer's output projection's weights are 1e5 times larger (planted: as a diverging
    run's grow) and its ``addmm`` passes float16's 65504. That call's inputs held the mask's
    -inf, so before, no chain could start there: the recorder named the layer and the replay
    its norm1 (whose NaN only followed), not reproduced. A mask's -inf is intended, as an
    ``allow_inf`` input's is: now both name the attention's projection, an overflow."""
    model = I.TutorialLM()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = nn.CrossEntropyLoss()
    mask = nn.Transformer.generate_square_subsequent_mask(I.CTX)
    with pytest.raises(NonFiniteError) as info, FlightRecorder(
            model, opt, loss_fn=crit, out_dir=out_dir, factory="infinity_models:make_tutorial_lm"):
        for step in range(6):
            src, tgt = I.token_batch(step)
            if step == K:
                with torch.no_grad():
                    model.encoder.layers[1].self_attn.out_proj.weight.mul_(1e5)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(src, src_mask=mask)
            crit(out.float().reshape(-1, I.VOCAB), tgt.reshape(-1)).backward()
            opt.step()
    check_event(info.value.event, step=K, phase="forward", module="encoder.layers.1.self_attn",
                kind="+inf")
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"], rep["reproduced"]) == \
        ("encoder.layers.1.self_attn", "aten.addmm", "+inf", [0, 1, 2, 3], "overflow", True), o
    assert "beyond float16's largest value" in rep["hint"], rep["hint"]


def test_float16_scores_overflowing_beside_a_mask_passed_by_position_name_the_attention(
        out_dir):
    """A hand-written GPT whose forward builds the causal mask and hands it to each attention
    by position, ``self.attn(self.ln(x), mask)``, under float16 autocast. At step 3 the second
    block's ``qkv`` weights are 300 times larger (planted) and its scores ``q @ k.T`` pass
    float16's 65504: +-inf, whose softmax is NaN, in the attention's own code. Its inputs held
    the mask's -inf, so before, the chain went out to the first caller with finite inputs,
    the root (its input is token ids), and said its own code made it; the forward's parameter
    is named ``mask``: its -inf is intended, and the attention is named, its matmul an
    overflow."""
    model = I.make_positional_mask_gpt()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info, FlightRecorder(
            model, opt, loss_fn=crit, out_dir=out_dir,
            factory="infinity_models:make_positional_mask_gpt"):
        for step in range(6):
            src, tgt = I.token_batch(step)
            if step == K:
                with torch.no_grad():
                    model.blocks[1].attn.qkv.weight.mul_(300.0)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(src)
            crit(out.float().reshape(-1, I.VOCAB), tgt.reshape(-1)).backward()
            opt.step()
    check_event(info.value.event, step=K, phase="forward", module="blocks.1.attn",
                inputs_finite=True)
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], rep["cause"], rep["reproduced"]) == \
        ("blocks.1.attn", "aten.bmm", "overflow", True), o
    assert o["source"] == source_line("infinity_models.py", "att = q @ k.transpose"), o


def test_inf_reaching_the_root_output_is_an_event(out_dir):
    def make(step):
        x, y = I.batch(step)
        if step == K:
            x[2] *= 1e2  # exp of a few hundred: +inf in float32, finite in float64
        return x, y

    err = _train("make_exp_out", make, out_dir)
    check_event(err.event, step=K, phase="forward", module="out", kind="+inf",
                inputs_finite=True, samples=[2])
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("out", "aten.exp", "+inf", [2])
    assert rep["cause"] == "overflow" and rep["reproduced"] is True


def test_nan_after_an_intended_mask_is_blamed_on_its_maker_not_the_mask(out_dir):
    def make(step):
        x, y = torch.rand(16, I.D_IN, generator=torch.Generator().manual_seed(step)), \
            torch.randint(0, I.N_CLASSES, (16,), generator=torch.Generator().manual_seed(step))
        if step == K:
            x[6] = -3.0  # log(1 + x) of a negative
        return x, y

    err = _train("make_mask_then_log", make, out_dir)
    check_event(err.event, step=K, phase="forward", module="feat", kind="nan",
                inputs_finite=True, samples=[6])
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("feat", "aten.log", "nan", [6])
    assert rep["cause"] == "invalid" and rep["reproduced"] is True
    # strict: the same model stops at step 0 on the mask, as before
    strict = _train("make_mask_then_log", make, out_dir / "strict", strict_inf=True)
    check_event(strict.event, step=0, phase="forward", module="mask", kind="-inf")


def test_nan_from_an_additive_mask_passed_in_is_the_softmax_not_bad_data(out_dir):
    """An additive padding mask (0 / -inf per key) passed into forward, as a Hugging Face
    model's 4-D mask is: by default its -inf is intended, so the NaN that a row with every key
    masked makes (softmax of an all -inf row, sample 2 at step K) is a forward event in the
    attention, op softmax, cause invalid. It was an ``input`` event on the mask with every
    padded row as samples, and the hint said to fix the data pipeline."""
    model = I.make_masked_encoder()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    crit = nn.CrossEntropyLoss()
    T = 6
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="infinity_models:make_masked_encoder"):
            for step in range(6):
                x, y = I.batch(step, n=8)
                x = x[:, None, :].expand(8, T, I.D_IN).contiguous()
                mask = torch.zeros(8, 1, T)
                mask[:, :, T - 2:] = -math.inf  # every row has two padding positions
                if step == K:
                    mask[2] = -math.inf  # an empty sequence: every key masked
                opt.zero_grad()
                crit(model(x, mask), y).backward()
                opt.step()
    check_event(info.value.event, step=K, phase="forward", module="attn", kind="nan",
                samples=[2])
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"], rep["cause"], rep["reproduced"]) \
        == ("forward", "attn", "aten._softmax", [2], "invalid", True), o
    assert "every entry is -inf" in rep["hint"], rep["hint"]


def test_mask_made_by_multiplying_by_inf_is_named_as_0_times_inf(out_dir):
    """A 0/1 attention mask made additive by arithmetic, ``(1 - mask) * float("-inf")``, is
    ``0 * -inf`` = NaN at every real token, from step 0. The replay named aten.mul in the root
    but gave the generic hint (clamp before log/sqrt, add eps to denominators): the -inf was a
    Python number, not an input tensor, so the op had no evidence. It now says 0 * inf with
    the literal -inf and how to place the infinity without arithmetic."""
    model = I.make_arith_mask_encoder()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    crit = nn.CrossEntropyLoss()
    T = 6
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="infinity_models:make_arith_mask_encoder"):
            for step in range(3):
                x, y = I.batch(step, n=8)
                x = x[:, None, :].expand(8, T, I.D_IN).contiguous()
                attention_mask = torch.ones(8, T)
                attention_mask[:, T - 2:] = 0.0  # two padding positions per row
                opt.zero_grad()
                crit(model(x, attention_mask), y).backward()
                opt.step()
    check_event(info.value.event, step=0, phase="forward", module="", kind="nan",
                inputs_finite=True)
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], rep["cause"], rep["reproduced"]) \
        == ("forward", "", "aten.mul", "invalid", True), o
    line = _line_of("0 * -inf is NaN")
    assert o["source"].endswith(f"infinity_models.py:{line}"), o["source"]
    assert "0 * inf with the literal -inf" in rep["hint"], rep["hint"]
    assert "masked_fill(mask, float('-inf'))" in rep["hint"], rep["hint"]


def _line_of(text: str) -> int:
    lines = (HERE / "infinity_models.py").read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)


def test_nan_in_a_mask_every_sample_shares_names_no_sample(out_dir):
    """The tutorial loop with an ALiBi-style bias added to the causal mask, ``slope * dist``,
    whose slope a schedule made NaN at step K: the (T, T) mask passed to forward holds NaN.
    The event said 'Tensor args[1], samples []' and the replay's hint told the user to check
    the data pipeline 'for these samples'; it names no sample, says the tensor is not per
    sample and to check the code that makes it."""
    model = I.make_tutorial_lm()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = nn.CrossEntropyLoss()
    causal = nn.Transformer.generate_square_subsequent_mask(I.CTX)
    dist = (torch.arange(I.CTX)[None] - torch.arange(I.CTX)[:, None]).float().clamp(max=0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="infinity_models:make_tutorial_lm"):
            for step in range(6):
                src, tgt = I.token_batch(step)
                slope = math.nan if step == K else 0.5
                opt.zero_grad()
                out = model(src, causal + slope * dist)
                crit(out.reshape(-1, I.VOCAB), tgt.reshape(-1)).backward()
                opt.step()
    check_event(info.value.event, step=K, phase="input", tensor="args[1]", samples=[])
    assert "Tensor args[1] (not per sample)." in str(info.value), str(info.value)
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["tensor"], o["samples"], rep["cause"]) == \
        ("input", "args[1]", [], "input"), o
    assert rep["hint"].startswith("the input args[1] holds NaN/Inf and is not per sample"), \
        rep["hint"]


# (at lr=1e5 the scores' sums meet +inf and -inf, or not, in the order the CPU's bmm kernel
# adds them: NaN on AMD EPYC, +inf on Intel Xeon; either way the same op overflowed)
@pytest.mark.parametrize("lr, op, made", [(1e4, "aten.addmm", {"+inf"}),
                                          (1e5, "aten.bmm", {"nan", "+inf"})])
def test_overflow_in_an_attention_given_the_padding_mask_names_the_attention(
        out_dir, lr, op, made):
    """nn.TransformerEncoder (norm_first) gives each attention its bool padding mask as a
    -inf float mask. A schedule's jump of the
    learning rate at step 3 blows the weights up, and at step 5 the first layer's attention
    overflows (at lr=1e4 it returns +inf, which the layer's norm turns into NaN; at lr=1e5 its
    own scores go NaN). Module statistics stopped at the encoder, whose inputs were finite,
    and the replay named the encoder too; the replay then named the attention, whose own code
    ran the op, and now the recorder does too: the mask's -inf, passed as ``attn_mask``, is
    intended, and leaves the attention's inputs finite."""
    model = I.make_padded_encoder_classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="infinity_models:make_padded_encoder_classifier"):
            for step in range(12):
                for group in opt.param_groups:
                    group["lr"] = 0.01 if step < 3 else lr
                g = torch.Generator().manual_seed(step)
                ids = torch.randint(1, I.VOCAB, (8, I.CTX), generator=g)
                ids[:, 6:] = 0  # padding
                opt.zero_grad()
                crit(model(ids), torch.randint(0, I.N_CLASSES, (8,), generator=g)).backward()
                opt.step()
    check_event(info.value.event, step=5, phase="forward", module="encoder.layers.0.self_attn",
                inputs_finite=True)
    assert info.value.event["kind"] in made, info.value.event
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["call"], o["op"], rep["cause"], rep["reproduced"]) == \
        ("encoder.layers.0.self_attn", 0, op, "overflow", True), o
    assert o["made"] in made, o


def test_inf_in_the_data_that_turns_into_nan_is_an_input_event(out_dir):
    def make(step):
        x, y = I.batch(step)
        if step == K:
            x[3, 1] = math.inf
        return x, y

    err = _train("make_half_then_norm", make, out_dir)
    check_event(err.event, step=K, phase="input", tensor="batch", samples=[3], kind="+inf")
    # the message says it came in with the batch, not that the root "first made" it from
    # finite inputs (the batch's +Inf is allowed inside, so its inputs counted as finite)
    msg = str(err)
    assert "It came in with the input of '<root>' (micro-batch 0). Tensor batch, samples [3]." \
        in msg and "First made" not in msg and "whose inputs were finite" not in msg, msg
    rep = nanreplay_json(err.bundle_path)
    assert rep["cause"] == "input"
    assert (rep["origin"]["tensor"], rep["origin"]["samples"]) == ("batch", [3])


# ---------------------------------------------------------------------------------------------
# the setting


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_strict_inf_is_validated(out_dir, bad):
    with pytest.raises(TypeError, match=r"strict_inf must be True .* or False"):
        FlightRecorder(nn.Linear(2, 2), out_dir=out_dir, strict_inf=bad)
    with pytest.raises(TypeError, match="strict_inf must be"):
        FlightRecorderCallback(strict_inf=bad)


def test_bundle_records_the_policy(out_dir):
    err = _train("make_exp_out", lambda s: (I.batch(s)[0] * (1e2 if s == K else 1),
                                            I.batch(s)[1]), out_dir)
    meta, _ = read_bundle(err.bundle_path)
    assert meta["strict_inf"] is False
    err = _train("make_mask_then_log", lambda s: (torch.rand(16, I.D_IN), I.batch(s)[1]),
                 out_dir / "strict", strict_inf=True)
    meta, _ = read_bundle(err.bundle_path)
    assert meta["strict_inf"] is True and err.event["step"] == 0


def test_strict_allowed_mask_input_is_not_blamed_for_a_later_nan(out_dir):
    """strict_inf with the mask input exempt by name: the log's NaN is the event, and the
    replay does not take the mask's -inf in the batch for bad data."""
    mask = torch.zeros(I.HIDDEN)
    mask[-2:] = -math.inf
    model = I.MaskInputThenLog()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, strict_inf=True,
                            allow_inf=["mask"], factory="infinity_models:make_mask_input_then_log"):
            for step in range(6):
                x = torch.rand(16, I.D_IN, generator=torch.Generator().manual_seed(step))
                if step == K:
                    x[6] = -3.0
                opt.zero_grad()
                crit(model(x, mask=mask), torch.arange(16) % I.N_CLASSES).backward()
                opt.step()
    check_event(info.value.event, step=K, phase="forward", module="feat", kind="nan")
    rep = nanreplay_json(info.value.bundle_path)
    assert (rep["cause"], rep["origin"]["module"], rep["origin"]["op"]) == \
        ("invalid", "feat", "aten.log"), rep["origin"]


def test_strict_event_at_a_mask_buffer_names_the_op_not_bad_weights(out_dir):
    """strict_inf=True on a GPT whose mask module adds a -inf buffer, without allow_inf: the
    recorder stops at the mask's output, and the replay names the op that passed the buffer's
    -inf on and the allow_inf pattern to add. It blamed the buffer as a parameter that was
    non-finite before the step (cause weights: look for a checkpoint loader)."""
    model = I.make_mask_buffer_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, strict_inf=True,
                            factory="infinity_models:make_mask_buffer_gpt"):
            for step in range(3):
                idx, tgt = I.token_batch(step)
                opt.zero_grad()
                crit(model(idx).flatten(0, 1), tgt.flatten()).backward()
                opt.step()
    check_event(info.value.event, step=0, phase="forward", module="attn.0.mask", kind="-inf")
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["call"], o["op"]) == ("forward", "attn.0.mask", 0,
                                                              "aten.add"), o
    assert rep["reproduced"] is True and rep["cause"] == "invalid"
    assert o["source"] == "infinity_models.py:224" and o["chain"][0]["intentional"] is True
    assert rep["hint"].startswith("aten.add passed on the -Inf of buffer 'attn.0.mask.bias' on "
                                  "purpose (a mask)")
    assert any("allow_inf=['attn.0.mask']" in p for p in rep["problems"]), rep["problems"]


def _tied_lm_run(out_dir, lr, sliced=False, qk_scale_at=None, **rec_kwargs):
    model = I.make_tied_mask_lm(sliced=sliced)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    crit = nn.CrossEntropyLoss()
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                        factory="infinity_models:make_tied_mask_lm",
                        factory_kwargs={"sliced": sliced}, **rec_kwargs):
        for step in range(12):
            if step == qk_scale_at:  # query and key rows loaded in the wrong unit
                with torch.no_grad():
                    model.blocks[0].attn.in_proj_weight[: 2 * I.D] *= 1e20
            idx, tgt = I.token_batch(step)
            opt.zero_grad()
            crit(model(idx).flatten(0, 1), tgt.flatten()).backward()
            opt.step()


@pytest.mark.parametrize("sliced", [False, True], ids=["buffer", "buffer-slice"])
def test_nan_made_next_to_a_mask_buffer_is_blamed_on_the_attention(out_dir, sliced):
    """A pre-LN LM with a tied output layer passes its -inf causal mask (a buffer) to
    nn.MultiheadAttention; at step 3 the loop loads query and key rows stored 1e20 times too
    large, and the attention scores overflow float32, which the softmax turns into NaN. The
    NaN is blamed on the attention module, whose only infinity was the mask; it was blamed on
    the root, as if the model's own code had made that -inf; a slice of the buffer (a view)
    was too, after the buffer itself no longer was. (The planted rows make the attention
    overflow first on every CPU; a diverging learning rate overflows the second LayerNorm
    first on an AMD EPYC, the attention first on an Intel Xeon.)"""
    _tied_lm_run(out_dir / "healthy", lr=0.1, sliced=sliced)  # no event at a sane rate
    with pytest.raises(NonFiniteError) as info:
        _tied_lm_run(out_dir, lr=0.1, sliced=sliced, qk_scale_at=3)
    check_event(info.value.event, phase="forward", module="blocks.0.attn", call=0,
                kind="nan", inputs_finite=True)
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], o["phase"], o["module"], o["call"]) == \
        (True, "forward", "blocks.0.attn", 0), o
    assert o["op"].startswith("aten._scaled_dot_product"), o


def test_scores_overflowing_beside_a_mask_are_an_overflow_of_a_diverging_run(out_dir):
    """The same LM at a diverging learning rate (50): where the attention op makes the NaN
    (an Intel Xeon), its inputs held the mask's -inf, but the float64 re-run of its call is
    finite, so no infinity met another in exact arithmetic: its scores overflowed float32,
    and the loss had jumped before (diverging). It was called invalid ('NaN in exact
    arithmetic too'), with advice to find the op that made the first infinity (the mask).
    (On an AMD EPYC the second LayerNorm's variance overflows first: an overflow too.)"""
    with pytest.raises(NonFiniteError) as info:
        _tied_lm_run(out_dir, lr=50.0)
    rep = nanreplay_json(info.value.bundle_path)
    assert rep["cause"] == "overflow", rep["hint"]
    # (the scores' softmax on an Intel Xeon, finite in float64; the second LayerNorm's
    # variance on an AMD EPYC, whose result fits and float64 holds what it sums)
    assert "float64" in rep["hint"] and "lower the learning rate" in rep["hint"], rep["hint"]


def test_a_diverging_run_recorded_with_rewind_is_not_told_to_record_with_rewind(out_dir):
    """The same diverging LM recorded with ``rewind=4``: the hint asked to record with
    ``FlightRecorder(..., rewind=N)`` so that --try could re-run the steps, which the bundle
    already does; it now points at the what-ifs, and lr=0.1x re-runs finite."""
    with pytest.raises(NonFiniteError) as info:
        _tied_lm_run(out_dir, lr=50.0, rewind=4)
    res = CliRunner().invoke(cli, [str(info.value.bundle_path), "--json", "--try", "lr=0.1x"])
    rep = json.loads(res.output)
    assert rep["cause"] == "overflow" and rep["window"] is not None
    assert "rewind=N" not in rep["hint"], rep["hint"]
    assert "--try lr=0.1x and clip=1.0 re-run the bundle's rewind window" in rep["hint"], \
        rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]
