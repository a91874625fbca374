"""End to end: sequence-to-sequence summarization training (``summarization_models``: the
nn.Transformer tutorial's model with its three key padding masks, a copy Transformer, See et
al.'s pointer-generator with coverage and scheduled sampling) under the recorder, with a
DataLoader's padding collate_fn, gradient accumulation over variable-length micro-batches,
clipping and a warmup + inverse-sqrt schedule; planted bugs replayed with the CLI."""

from __future__ import annotations

from functools import partial

import pytest
import summarization_models as M
import torch
from bundles import nanreplay_json, source_line
from torch.utils.data import DataLoader

from recorder import FlightRecorder, NonFiniteError

# the tutorial's float causal mask beside boolean padding masks: torch warns, users train on
pytestmark = [pytest.mark.usefixtures("in_tests_dir"),
              pytest.mark.filterwarnings("ignore:Support for mismatched")]

MODELS = "summarization_models.py"
ACCUM = 2


def seq2seq_call(model, loss_fn, batch):
    src, tgt_in, tgt_out = batch
    return loss_fn(model(src, tgt_in), tgt_out)


def copy_call(model, loss_fn, batch):
    src, src_ext, _, tgt_in, tgt_out, n_oov = batch
    return loss_fn(model(src, src_ext, tgt_in, n_oov), tgt_out)


def pointer_call(model, loss_fn, batch):
    src, src_ext, lens, tgt_in, tgt_out, n_oov = batch
    return loss_fn(model(src, src_ext, lens, tgt_in, n_oov, ss_prob=0.25), tgt_out)


def train(model, loader, call, loss_fn, out_dir=None, factory=None, amp=None, **rec_kw):
    """Teacher-forced (or scheduled-sampling) training with ACCUM micro-batches per update,
    clipping and Noam's schedule, under CPU autocast in ``amp`` (float16 with a GradScaler);
    under the recorder when ``out_dir`` is given."""
    opt = torch.optim.Adam(model.parameters(), lr=0.5, betas=(0.9, 0.98), eps=1e-9)
    sched = M.noam(opt)
    scaler = torch.amp.GradScaler("cpu", enabled=amp == torch.float16)
    rec = None
    if out_dir is not None:
        rec = FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=out_dir, scaler=scaler,
                             factory=f"summarization_models:{factory}", **rec_kw).attach()
        loss_fn = rec.loss_fn
    try:
        opt.zero_grad()
        for i, batch in enumerate(loader):
            with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
                loss = call(model, loss_fn, batch) / ACCUM
            scaler.scale(loss).backward()
            if (i + 1) % ACCUM == 0:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(opt)
                scaler.update()
                sched.step()
                opt.zero_grad()
        if rec is not None:
            rec.end_step()
    finally:
        if rec is not None:
            rec.detach()
    return model


def loader(data, collate, batch_size=3):
    return DataLoader(data, batch_size=batch_size, collate_fn=collate)


def event(out_dir, factory, loss_fn, data, collate, call, **rec_kw) -> NonFiniteError:
    torch.manual_seed(1)        # dropout and scheduled sampling draw from the global RNG
    model = getattr(M, factory)()
    with pytest.raises(NonFiniteError) as info:
        train(model, loader(data, collate), call, loss_fn, out_dir, factory, **rec_kw)
    return info.value


def healthy(out_dir, factory, loss_fn, data, collate, call, amp=None, **rec_kw):
    """The same run with and without the recorder: no event, the same weights bit for bit."""
    runs = []
    for recorded in (False, True):
        torch.manual_seed(1)
        model = getattr(M, factory)()
        train(model, loader(data, collate), call, loss_fn,
              out_dir if recorded else None, factory, amp, **rec_kw)
        runs.append(model.state_dict())
    assert not list(out_dir.glob("*.nan"))
    for name, t in runs[0].items():
        assert torch.equal(t, runs[1][name]), name
    return runs[1]


def replay(err, problems=0):
    rep = nanreplay_json(err.bundle_path)
    assert (rep["reproduced"], len(rep["problems"]), rep["fidelity"]["matches"]) == (
        True, problems, True), rep
    return rep, rep["origin"]


def micro_batch(data, collate, err):
    """The collated micro-batch of the event (batch_size 3, ACCUM per step)."""
    i = err.event["step"] * ACCUM + err.event["micro_batch"]
    return collate(data[3 * i: 3 * i + 3])


def assert_unfilled(hint: str, zeros_line: str):
    """The hint names the line whose constant zeros the log took, and asks for no eps."""
    assert hint.startswith("aten.log of 0"), hint
    assert f"the zeros made at {source_line(MODELS, zeros_line)} reached aten.log" in hint, hint
    assert "Check the index" in hint and "add an eps" not in hint, hint


# ---------------------------------------------------------------------------------------------
# healthy padded batches


def test_transformer_on_padded_batches_raises_nothing_and_trains_the_same(tmp_path):
    # -inf in the causal mask, masked keys in every attention, PAD targets ignored
    data = M.corpus(24)
    healthy(tmp_path, "make_seq2seq", M.Seq2SeqLoss(), data, M.collate_seq2seq, seq2seq_call)


def test_an_empty_article_in_nn_transformer_itself_is_no_event(tmp_path):
    # torch's attention gives a row with every key masked zeros, not NaN, where it does not
    # return the weights (the encoder's and decoder's): nothing to report, the same weights
    data = M.corpus(12, empty_article={4})
    healthy(tmp_path, "make_seq2seq", M.Seq2SeqLoss(), data, M.collate_seq2seq, seq2seq_call)


def test_copy_transformer_and_pointer_generator_train_the_same_under_the_recorder(tmp_path):
    # the extended vocabulary's zero slots, coverage, scheduled sampling's draws
    data = M.corpus(12)
    healthy(tmp_path, "make_copy", M.copy_nll, data, M.collate_pointer, copy_call)
    healthy(tmp_path, "make_pointer", M.pointer_loss, data, M.collate_pointer, pointer_call)


# (a GradScaler's skipped first step makes torch warn of the scheduler stepping first)
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler")
@pytest.mark.parametrize("amp", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_copy_transformer_under_autocast_trains_the_same_under_the_recorder(tmp_path, amp):
    # half attention scores beside -inf masks; float16's GradScaler unscales before clipping
    data = M.corpus(12)
    healthy(tmp_path, "make_copy", M.copy_nll, data, M.collate_pointer, copy_call, amp)


# ---------------------------------------------------------------------------------------------
# planted bugs


def test_empty_targets_after_truncation_are_a_loss_event_of_ignore_index_0_over_0(tmp_path):
    # micro-batch 1 of step 2 (examples 15-17) has no target token left: CE's mean over 0
    data = M.corpus(24, empty_summary={15, 16, 17})
    err = event(tmp_path, "make_seq2seq", M.Seq2SeqLoss(), data, M.collate_seq2seq,
                seq2seq_call)
    assert (err.event["step"], err.event["micro_batch"], err.event["phase"]) == (2, 1, "loss")
    rep, o = replay(err)
    assert (rep["cause"], o["module"], o["op"], o["made"]) == (
        "invalid", "<loss>", "aten.nll_loss_forward", "nan"), rep
    assert o["source"] == source_line(MODELS, "return self.ce(logits.reshape")
    # a scalar 0/0 of the whole micro-batch: its rows (examples 15-17, every one with no
    # target) are named, and the hint says it is that micro-batch of the step's, not the
    # batch (it said "every target of the batch" and to skip such batches)
    assert (o["micro_batch"], o["samples"]) == (1, [0, 1, 2]), o
    assert "every target of micro-batch 1 (of " in rep["hint"], rep["hint"]
    assert "divide by the count of targets over the whole step" in rep["hint"], rep["hint"]


def test_all_padding_source_names_the_copy_attention_softmax_and_the_sentence(tmp_path):
    # article 10 is empty: the copy attention (need_weights) softmaxes a row of -inf keys
    data = M.corpus(24, empty_article={10})
    err = event(tmp_path, "make_copy", M.copy_nll, data, M.collate_pointer, copy_call)
    assert (err.event["step"], err.event["micro_batch"], err.event["phase"]) == (1, 1, "forward")
    rep, o = replay(err)
    assert (rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        "invalid", "copy_attn", "aten._softmax", "nan", [10 - 9]), rep
    assert o["source"] == source_line(MODELS, "self.copy_attn(h, memory, memory")
    assert "fully masked row" in rep["hint"] and "keep at least one key" in rep["hint"]


def test_label_smoothing_over_the_extended_vocabulary_takes_log_of_its_zero_slots(tmp_path):
    # fairseq's smoothing term sums log p over every slot: an article with fewer OOVs than
    # the batch's widest has slots of exactly 0
    data = M.corpus(12)
    err = event(tmp_path, "make_copy", M.smoothed_copy_nll, data, M.collate_pointer, copy_call)
    assert (err.event["step"], err.event["phase"]) == (0, "loss")
    *_, n_oov = batch = micro_batch(data, M.collate_pointer, err)
    fewer = [i for i, row in enumerate(batch[1]) if len(set(row[row >= M.VOCAB].tolist())) < n_oov]
    rep, o = replay(err)
    assert fewer and (rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        "invalid", "<loss>", "aten.log", "-inf", fewer), rep
    assert o["source"] == source_line(MODELS, "lprobs = torch.log(final)")
    # (was: "clamp the op's input away from the pole or add an eps", which hides the slots)
    assert_unfilled(rep["hint"], "final.new_zeros(*final.shape[:2], n_oov)")


def test_targets_mapped_to_another_articles_oov_slot_are_log_0_in_the_pointer_loss(tmp_path):
    data = M.corpus(12)
    collate = partial(M.collate_pointer, batch_oovs_for_targets=True)
    err = event(tmp_path, "make_pointer", M.pointer_loss, data, collate, pointer_call)
    assert (err.event["step"], err.event["phase"]) == (0, "loss")
    _, src_ext, _, _, tgt_out, _ = micro_batch(data, collate, err)
    unreachable = [i for i in range(len(tgt_out))
                   if set(tgt_out[i][tgt_out[i] >= M.VOCAB].tolist()) - set(src_ext[i].tolist())]
    rep, o = replay(err)
    assert unreachable and (rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        "invalid", "<loss>", "aten.log", "-inf", unreachable), rep
    assert o["source"] == source_line(MODELS, "step_loss = -torch.log(gold_probs)")
    assert_unfilled(rep["hint"], "final.new_zeros(final.size(0), n_oov)")


def test_saturated_p_gen_rounds_the_copy_mass_to_0_a_precision_cause(tmp_path):
    # p_gen = sigmoid(20) rounds to 1 in float32: (1 - p_gen) * attn is 0 for every OOV target
    data = M.corpus(12)
    err = event(tmp_path, "make_pointer_saturated", M.pointer_loss, data, M.collate_pointer,
                pointer_call)
    assert (err.event["step"], err.event["phase"]) == (0, "loss")
    tgt_out = micro_batch(data, M.collate_pointer, err)[4]
    copied = [i for i in range(len(tgt_out)) if (tgt_out[i] >= M.VOCAB).any()]
    rep, o = replay(err)
    assert copied and (rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        "precision", "<loss>", "aten.log", "-inf", copied), rep
    assert o["source"] == source_line(MODELS, "step_loss = -torch.log(gold_probs)")
    # rounding, not a constant: the hint asks for a stable formula, names no unfilled slot
    assert "log(1 - sigmoid(z))" in rep["hint"] and "constants" not in rep["hint"], rep["hint"]


def test_one_empty_summary_is_0_over_0_in_the_per_summary_mean_of_its_sentence(tmp_path):
    # See et al. average each summary's loss over its own length: summary 10 has none; the
    # second micro-batch's scheduled-sampling draws re-run as drawn (fidelity matches)
    data = M.corpus(12, empty_summary={10})
    err = event(tmp_path, "make_pointer", M.pointer_loss, data, M.collate_pointer, pointer_call)
    assert (err.event["step"], err.event["micro_batch"], err.event["phase"]) == (1, 1, "loss")
    rep, o = replay(err)
    assert (rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        "invalid", "<loss>", "aten.div", "nan", [10 - 9]), rep
    assert o["source"] == source_line(MODELS, "return (step_loss.sum(1) / dec_mask.sum(1))")
    # the 0 count is the data's, no constant of the model's: the 0/0 advice stands
    assert "skip the rows where it is 0" in rep["hint"] and "constants" not in rep["hint"]


def test_log_of_the_whole_copy_distribution_is_nan_only_in_its_backward(tmp_path):
    # nll_loss picks filled slots (a finite loss); log's backward at the unfilled slots is
    # 0 * inf: NaN in the gradient entering the model output, which cat's backward then drops
    data = M.corpus(12)
    err = event(tmp_path, "make_copy", M.copy_nll_of_log, data, M.collate_pointer, copy_call)
    assert (err.event["step"], err.event["phase"]) == (0, "backward")
    *_, n_oov = batch = micro_batch(data, M.collate_pointer, err)
    fewer = [i for i, row in enumerate(batch[1]) if len(set(row[row >= M.VOCAB].tolist())) < n_oov]
    assert err.event["samples"] == fewer
    rep, o = replay(err, problems=1)
    assert fewer and (rep["cause"], o["phase"], o["module"], o["op"], o["samples"]) == (
        "invalid", "backward", "<loss>", "LogBackward0", fewer), rep
    assert o["source"] == source_line(MODELS, "every slot, filled or not")
    assert "every parameter's gradient stayed finite" in rep["problems"][0], rep["problems"]


def test_oov_words_mapped_to_the_padding_id_leave_their_copy_slots_at_0(tmp_path):
    # word2id.get(w, 0): the article's OOV words are padding to the attention mask, so their
    # slots of the extended vocabulary get no copy mass and a copied target's log is log 0
    data = M.corpus(12)
    collate = partial(M.collate_pointer, unknown=M.PAD)
    err = event(tmp_path, "make_pointer", M.pointer_loss, data, collate, pointer_call)
    assert (err.event["step"], err.event["phase"]) == (0, "loss")
    tgt_out = micro_batch(data, collate, err)[4]
    copied = [i for i in range(len(tgt_out)) if (tgt_out[i] >= M.VOCAB).any()]
    rep, o = replay(err)
    assert copied and (rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        "invalid", "<loss>", "aten.log", "-inf", copied), rep
    assert o["source"] == source_line(MODELS, "step_loss = -torch.log(gold_probs)")
    assert_unfilled(rep["hint"], "final.new_zeros(final.size(0), n_oov)")
    assert "a source position the mask hides" in rep["hint"], rep["hint"]


def test_a_copy_only_vocabulary_names_the_masked_fill_it_returned_not_the_causal_mask(tmp_path):
    # the -inf of the logits outside the article reaches the output (an event by default);
    # the causal mask's full(-inf) came first in the call but attention consumed it
    err = event(tmp_path, "make_constrained", M.Seq2SeqLoss(0.0), M.corpus(12),
                M.collate_seq2seq, seq2seq_call)
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (0, "forward", "")
    rep, o = replay(err, problems=1)
    # (was: aten.full at generate_square_subsequent_mask's line, which returned nothing)
    assert (rep["cause"], o["module"], o["op"], o["made"]) == (
        "invalid", "", "aten.masked_fill", "-inf"), rep
    assert o["source"] == source_line(MODELS, 'return logits.masked_fill(~allowed')
    assert [c["op"] for c in o["chain"]] == ["aten.masked_fill"], o["chain"]
    assert rep["problems"][0].startswith("aten.masked_fill fills a literal -inf"), rep
    assert "allow_inf=['']" in rep["problems"][0]


def test_a_copy_only_vocabulary_allowed_trains_and_its_label_smoothing_is_named(tmp_path):
    data = M.corpus(12)
    healthy(tmp_path / "ok", "make_constrained", M.Seq2SeqLoss(0.0), data, M.collate_seq2seq,
            seq2seq_call, allow_inf=[""])
    # smoothing spreads target mass over the masked words: 0.1/V * -inf
    err = event(tmp_path, "make_constrained", M.Seq2SeqLoss(0.1), data, M.collate_seq2seq,
                seq2seq_call, allow_inf=[""])
    assert (err.event["step"], err.event["phase"]) == (0, "loss")
    rep, o = replay(err)
    assert (rep["cause"], o["module"], o["op"], o["made"]) == (
        "invalid", "<loss>", "aten.sum", "-inf"), rep
    assert "label smoothing" in rep["hint"], rep["hint"]


def test_an_article_of_oov_words_only_is_0_over_0_in_the_attention_renormalisation(tmp_path):
    # word2id.get(w, 0) again: article 1 is OOV words only, all padding to the mask, and
    # softmax * mask / sum divides 0 by 0 at the first decoder step, before any loss
    data = M.corpus(12)
    data[1] = ([41, 45, 50, 44, 47], [45, 44])
    collate = partial(M.collate_pointer, unknown=M.PAD)
    err = event(tmp_path, "make_pointer", M.pointer_loss, data, collate, pointer_call)
    assert (err.event["step"], err.event["phase"], err.event["module"], err.event["call"]) == (
        0, "forward", "attention", 0)
    rep, o = replay(err)
    assert (rep["cause"], o["module"], o["call"], o["op"], o["made"], o["samples"]) == (
        "invalid", "attention", 0, "aten.div", "nan", [1]), rep
    assert o["source"] == source_line(MODELS, "attn_dist = attn_dist_ / normalization_factor")
    assert "0 by 0" in rep["hint"] and "constants" not in rep["hint"], rep["hint"]
