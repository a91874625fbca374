"""End to end: sequence-to-sequence training written as PyTorch's translation tutorial writes
it (``seq2seq_transformer_models``: ``nn.Transformer`` with ``batch_first=True``, the float -inf
square subsequent ``tgt_mask``, bool padding masks, teacher forcing, label-smoothed
cross-entropy ignoring the padding, Adam under a warmup ``LambdaLR``, a padding collate_fn),
trained under the recorder until a planted bug fires, then replayed with the CLI.

The intended -inf masks are no event. In training, ``nn.Transformer``'s own layers ask
``nn.MultiheadAttention`` for no weights and its scaled-dot-product path gives a fully masked
query row zeros, not NaN; a decoder layer that keeps its attention maps (``need_weights=True``,
the softmax path) makes NaN there, which the replay names.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import seq2seq_transformer_models as M
import torch
from bundles import line_number, nanreplay_json
from models import bundles
from torch import nn

from recorder import FlightRecorder, NonFiniteError

pytestmark = [pytest.mark.usefixtures("in_tests_dir"),
              pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask")]


def line_of(text: str) -> int:
    return line_number("seq2seq_transformer_models.py", text)


EMPTY_ROW, EMPTY_AT = 3, 2  # the source row that the planted batch pads whole, and its step


def blank_source(step, src):
    """The planted data bug: at ``EMPTY_AT`` one source sentence tokenised to nothing, all
    padding (a blank line of the corpus)."""
    if step == EMPTY_AT:
        src = src.clone()
        src[EMPTY_ROW] = M.PAD
    return src


def run(model, steps, out_dir=None, factory=None, masks=M.create_mask, data=None, half=False,
        at=None):
    """The tutorial's ``train_epoch`` for ``steps`` steps, under the recorder when ``out_dir``
    is given (a plain run otherwise, the tests' oracle): the losses, and the recorder."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.98), eps=1e-9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, M.warmup())
    crit = nn.CrossEntropyLoss(ignore_index=M.PAD, label_smoothing=0.1)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"seq2seq_transformer_models:{factory}") if out_dir else None
    losses = []
    with rec or contextlib.nullcontext():
        model.train()
        for step, (src, tgt) in enumerate(M.loader()):
            if step == steps:
                break
            if at is not None:
                at(step, model)
            src = data(step, src) if data is not None else src
            tgt_input, tgt_out = tgt[:, :-1], tgt[:, 1:]
            src_mask, tgt_mask, src_padding_mask, tgt_padding_mask = masks(src, tgt_input)
            with torch.autocast("cpu", dtype=torch.float16, enabled=half):
                logits = model(src, tgt_input, src_mask, tgt_mask, src_padding_mask,
                               tgt_padding_mask, src_padding_mask)
            loss = crit(logits.reshape(-1, logits.shape[-1]), tgt_out.reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.item())
    return losses, rec


def planted(out_dir, factory, steps, **kw):
    """The recorded run of a planted bug: its NonFiniteError."""
    with pytest.raises(NonFiniteError) as info:
        run(getattr(M, factory)(), steps, out_dir, factory, **kw)
    return info.value


def origin_of(rep):
    o = rep["origin"]
    return rep["reproduced"], rep["cause"], o["module"], o["op"], o["samples"]


# ---------------------------------------------------------------------------------------------
# the intended masks: no event


@pytest.mark.parametrize("factory", ["make_model", "make_model_with_maps"])
def test_tutorial_masks_train_without_event_and_as_a_plain_run(out_dir, factory):
    plain, _ = run(getattr(M, factory)(), 6)
    losses, rec = run(getattr(M, factory)(), 6, out_dir, factory)
    assert rec.event is None and rec.step == 6 and bundles(out_dir) == []
    assert losses == plain and all(map(math.isfinite, losses)), (losses, plain)


@pytest.mark.parametrize("bug", ["blank_source", "diagonal_mask"])
def test_nn_transformer_gives_fully_masked_rows_zeros_in_training_so_no_event(out_dir, bug):
    # (nn.Transformer's layers call attention with need_weights=False: torch's
    # scaled_dot_product path makes a query with no key 0, not NaN; the oracle is the plain run)
    kw = {"data": blank_source} if bug == "blank_source" else \
        {"masks": M.create_mask_with_diagonal}
    plain, _ = run(M.make_model(), 4, **kw)
    assert all(map(math.isfinite, plain)), plain
    losses, rec = run(M.make_model(), 4, out_dir, "make_model", **kw)
    assert rec.event is None and bundles(out_dir) == [] and losses == plain


# ---------------------------------------------------------------------------------------------
# planted bugs


def test_blank_source_sentence_names_the_cross_attention_softmax_and_its_sample(out_dir):
    err = planted(out_dir, "make_model_with_maps", 4, data=blank_source)
    ev = err.event
    assert (ev["step"], ev["phase"], ev["module"]) == (
        EMPTY_AT, "forward", "transformer.decoder.layers.0.multihead_attn"), ev
    rep = nanreplay_json(err.bundle_path)
    assert origin_of(rep) == (True, "invalid", "transformer.decoder.layers.0.multihead_attn",
                              "aten._softmax", [EMPTY_ROW]), rep
    assert rep["origin"]["source"] == f"seq2seq_transformer_models.py:{line_of('mem, mem')}"
    assert f"key_padding_mask is True (masked) at every position of samples [{EMPTY_ROW}]" \
        in rep["hint"], rep["hint"]


def test_causal_mask_masking_its_diagonal_names_decoder_self_attention_at_step_0(out_dir):
    err = planted(out_dir, "make_model_with_maps", 2, masks=M.create_mask_with_diagonal)
    ev = err.event
    assert (ev["step"], ev["phase"], ev["module"]) == (
        0, "forward", "transformer.decoder.layers.0.self_attn"), ev
    rep = nanreplay_json(err.bundle_path)
    assert origin_of(rep) == (True, "invalid", "transformer.decoder.layers.0.self_attn",
                              "aten._softmax", list(range(M.BATCH))), rep
    assert rep["origin"]["source"] == f"seq2seq_transformer_models.py:{line_of('x, x, x')}"
    hint = rep["hint"]
    # (was: the generic "keep at least one key per row ... or mask with a large finite
    # negative number", which hides a mask built wrong)
    assert "attn_mask masks every key of query position 0" in hint, hint
    assert "diagonal=1" in hint and "large finite negative" not in hint, hint


def test_causal_mask_hiding_the_bos_key_names_the_query_it_leaves_no_key(out_dir):
    err = planted(out_dir, "make_model_with_maps", 2, masks=M.create_mask_without_bos)
    assert (err.event["step"], err.event["phase"]) == (0, "forward"), err.event
    rep = nanreplay_json(err.bundle_path)
    assert origin_of(rep) == (True, "invalid", "transformer.decoder.layers.0.self_attn",
                              "aten._softmax", list(range(M.BATCH))), rep
    hint = rep["hint"]
    assert "attn_mask, one mask shared by every sample, masks every key of query positions " \
        "[0]" in hint, hint
    assert "diagonal=1" not in hint, hint


def overflow_rows(module_path, step):
    """Oracle: the samples whose output of ``module_path`` holds an infinity at ``step`` in a
    plain run of the same loop."""
    model, rows = M.make_model(), []

    def hook(m, args, out):
        rows[:] = [int(i) for i in torch.isinf(out).flatten(1).any(1).nonzero().flatten()]

    def arm(s, model):
        scale_up(s, model)
        if s == step:
            model.get_submodule(module_path).register_forward_hook(hook)

    run(model, step + 1, half=True, at=arm)
    return rows


def scale_up(step, model):
    """The planted bug: at step 2 a weight of the decoder's feed-forward grows 1e5-fold (a
    checkpoint's weights loaded in another scale), so its float16 projection overflows."""
    if step == 2:
        with torch.no_grad():
            model.transformer.decoder.layers[1].linear1.weight.mul_(1e5)


def test_float16_autocast_overflow_names_the_decoder_projection(out_dir):
    module = "transformer.decoder.layers.1.linear1"
    rows = overflow_rows(module, 2)
    assert rows, "the planted scale overflows no sample"
    err = planted(out_dir, "make_model", 4, half=True, at=scale_up)
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (
        2, "forward", module), err.event
    rep = nanreplay_json(err.bundle_path)
    assert origin_of(rep) == (True, "overflow", module, "aten.addmm", rows), rep
    assert (rep["origin"]["made"], rep["origin"]["dtype"]) == ("+inf", "float16"), rep["origin"]
