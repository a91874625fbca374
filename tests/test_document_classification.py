"""End to end: long-document classification (``document_classification_models``: a
hierarchical attention network over notes padded to whole sentences, LAAT's label-wise
attention over the codes, a mean-pooled baseline) trained on multi-label codes with a
DataLoader's fixed-size padding collate_fn, clipping and optional float16 autocast with a
GradScaler; planted bugs replayed with the CLI."""

from __future__ import annotations

import document_classification_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line
from torch.utils.data import DataLoader

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

MODELS = "document_classification_models.py"
BATCH = 4


def train(model, data, loss_fn, out_dir=None, factory=None, amp=None, eps=1e-8):
    """Adam, clipping at 5, float16 autocast with a GradScaler when ``amp``; under the recorder
    when ``out_dir`` is given."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=eps)
    scaler = torch.amp.GradScaler("cpu", enabled=amp == torch.float16)
    rec = None
    if out_dir is not None:
        rec = FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=out_dir, scaler=scaler,
                             factory=f"document_classification_models:{factory}").attach()
        loss_fn = rec.loss_fn
    try:
        for docs, words, n_sent, y in DataLoader(data, batch_size=BATCH, collate_fn=M.collate):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
                loss = loss_fn(model(docs, words, n_sent), y)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(opt)
            scaler.update()
    finally:
        if rec is not None:
            rec.detach()
    return model


def event(out_dir, factory, data, loss_fn, amp=None, eps=1e-8) -> NonFiniteError:
    torch.manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        train(getattr(M, factory)(), data, loss_fn, out_dir, factory, amp, eps)
    return info.value


def replay(err, notes: int = 0):
    """The report, reproduced and faithful, with ``notes`` notes."""
    rep = nanreplay_json(err.bundle_path)
    assert (rep["reproduced"], len(rep["problems"]), rep["fidelity"]["matches"]) == (
        True, notes, True), rep
    return rep, rep["origin"]


def bce():
    """BCEWithLogitsLoss with the pos_weight of a split that assigns every code."""
    return M.WeightedBCE(M.pos_weight(M.corpus(16)))


# ---------------------------------------------------------------------------------------------
# healthy


@pytest.mark.parametrize("factory, loss, amp", [
    ("make_han", "bce", None), ("make_laat", "f1", torch.float16)], ids=["han", "laat-fp16"])
def test_padded_notes_raise_nothing_and_train_the_same(tmp_path, factory, loss, amp):
    # padding sentences skipped at the word level, -inf masks, pack_padded_sequence, clipping
    data = M.corpus(16)
    runs = []
    for out_dir in (None, tmp_path):
        torch.manual_seed(0)
        loss_fn = bce() if loss == "bce" else M.soft_macro_f1
        runs.append(train(getattr(M, factory)(), data, loss_fn, out_dir, factory, amp)
                    .state_dict())
    assert not list(tmp_path.glob("*.nan"))
    for name, t in runs[0].items():
        assert torch.equal(t, runs[1][name]), name


# ---------------------------------------------------------------------------------------------
# planted bugs


def test_a_padding_sentence_through_the_word_attention_is_a_fully_masked_softmax(tmp_path):
    # every note has MAX_SENT sentences but note 6 (one): its padding sentences reach the word
    # attention with every word masked; the rows are sentences, the sample is the note
    data = M.corpus(16, min_sent=M.MAX_SENT, short={6})
    err = event(tmp_path, "make_han_unguarded", data, bce())
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (
        1, "forward", "word_attn")
    rep, o = replay(err)
    assert (rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        "invalid", "word_attn", "aten._softmax", "nan", [6 - BATCH]), rep
    assert o["source"] == source_line(MODELS, "alpha = F.softmax(scores, dim=-1)")
    assert "fully masked row" in rep["hint"] and "keep at least one key" in rep["hint"]
    # (was: that advice alone, which says nothing of the padding sentences)
    assert "Sample(s) 2 hold, and no other sample does, units of args[0] that are padding " \
        "throughout (sample 2, unit(s) 1, 2, 3, 4: a document padded" in rep["hint"], rep["hint"]
    assert "run it over the non-empty units only" in rep["hint"]


@pytest.mark.parametrize("factory, module, line", [
    ("make_han", "sent_attn", "alpha = F.softmax(scores, dim=-1)"),
    ("make_laat", "", "a = F.softmax(scores.masked_fill(~mask.unsqueeze(1)")],
    ids=["han", "laat"])
def test_an_empty_note_is_named_a_blank_record_under_the_sentence_softmax(tmp_path, factory,
                                                                          module, line):
    # note 9's text extraction gave no sentence: every sentence position of its row is masked,
    # at HAN's sentence attention and at LAAT's attention of every code
    data = M.corpus(16, empty={9})
    err = event(tmp_path, factory, data, bce())
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (2, "forward", module)
    rep, o = replay(err)
    assert (rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        "invalid", module, "aten._softmax", "nan", [9 - 2 * BATCH]), rep
    assert o["source"] == source_line(MODELS, line)
    # (was: the fully-masked-row advice alone, "keep at least one key per row")
    assert "But args[0] and args[1] are 0 everywhere in sample(s) 1 and not in any other " \
        "sample: a blank record (a document whose text extraction gave no sentence" \
        in rep["hint"], rep["hint"]
    assert "--try drop=1" in rep["hint"]


def test_a_code_the_split_never_assigns_has_pos_weight_inf(tmp_path):
    # (N - 0) / 0: the loss's buffer is inf at code 5 before any step
    data = M.corpus(16, never_coded={5})
    err = event(tmp_path, "make_han", data, M.WeightedBCE(M.pos_weight(data)))
    assert (err.event["step"], err.event["phase"]) == (0, "loss")
    rep, o = replay(err)
    assert (rep["cause"], o["module"], o["op"], o["made"]) == (
        "weights", "<loss>", "aten.binary_cross_entropy_with_logits", "nan"), rep
    assert o["source"] == source_line(MODELS, "return self.bce(logits, y)")
    assert "'bce.pos_weight' holding inf, inf at index 5, 8" in rep["hint"], rep["hint"]
    assert "count.clamp_min(1)" in rep["hint"]


def test_soft_macro_f1_of_a_rare_code_under_float16_is_an_underflow(tmp_path):
    # the output bias at log-odds of 1e-9 for the never-assigned code: sigmoid is 1e-9, 0 in
    # float16; tp, fp, fn all 0 in the float32 sums: 0/0 (was: "precision", "no value left
    # float32's range", as if rounding had crossed an edge)
    data = M.corpus(16, never_coded=M.NEVER_CODED)
    err = event(tmp_path, "make_han_prior", data, M.soft_macro_f1, torch.float16)
    assert (err.event["step"], err.event["phase"]) == (0, "loss")
    rep, o = replay(err)
    assert (rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        "underflow", "<loss>", "aten.div", "nan", []), rep
    assert o["source"] == source_line(MODELS, "f1 = 2 * tp / (2 * tp + fp + fn)")
    assert "below float16's smallest subnormal number 5.96e-08" in rep["hint"], rep["hint"]
    assert "(ops before it computed in float16)" in rep["hint"], rep["hint"]


def test_a_hand_written_softplus_of_the_rare_codes_logit_overflows_float16(tmp_path):
    # exp(20.7) in float16 is inf for every note at the never-assigned code
    data = M.corpus(16, never_coded=M.NEVER_CODED)
    err = event(tmp_path, "make_han_prior", data, M.logistic_loss, torch.float16)
    assert (err.event["step"], err.event["phase"]) == (0, "loss")
    rep, o = replay(err)
    assert (rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        "overflow", "<loss>", "aten.exp", "+inf", [0, 1, 2, 3]), rep
    assert o["source"] == source_line(MODELS, "loss = y * torch.log(1 + torch.exp(-logits))")
    assert "use F.softplus(z)" in rep["hint"], rep["hint"]
    # y is a label picking a branch, not padding (was: "the overflow is in entries the loss
    # leaves out (padded steps, ignored targets) ... Check what the padding holds")
    assert "a 0/1 factor the loss also takes as its complement (1 - y)" in rep["hint"]
    assert "padding holds" not in rep["hint"] and "no padding is involved" in rep["hint"]


def test_an_oov_vector_averaged_over_no_ngrams_is_a_nan_embedding_row(tmp_path):
    # fastText's OOV trick over an empty n-gram list: mean of nothing is NaN, in row RARE
    data = M.corpus(16, rare_word={6})
    err = event(tmp_path, "make_han_fasttext", data, bce())
    assert (err.event["step"], err.event["phase"], err.event["params"]) == (
        0, "weights", ["emb.weight"])
    rep = nanreplay_json(err.bundle_path)
    assert rep["cause"] == "weights", rep
    # (was: "aten.mean (inputs as low as nan) ... keep the op's input in its domain (clamp a
    # distance or a count away from 0 before a log or a division")
    assert f"aten.mean of an empty tensor made nan at {source_line(MODELS, '.mean(0)')}" \
        in rep["hint"], rep["hint"]
    assert "a reduction over no element is 0/0" in rep["hint"] and "as low as" not in rep["hint"]
    assert f"only row(s) {M.RARE} of {M.VOCAB} of emb.weight" in rep["hint"], rep["hint"]


def test_a_mean_over_no_words_behind_torch_where_is_nan_in_backward_only(tmp_path):
    # where(n > 0, sum / n, 0): the padding sentences' 0/0 is masked in forward, not in
    # DivBackward0; notes 0-3 all have padding sentences
    data = M.corpus(16)
    err = event(tmp_path, "make_mean_pool", data, bce())
    assert (err.event["step"], err.event["phase"]) == (0, "backward")
    rep, o = replay(err, notes=1)
    assert (rep["cause"], o["phase"], o["op"], o["made"], o["samples"]) == (
        "invalid", "backward", "DivBackward0", "nan", [0, 1, 2, 3]), rep
    # the loop's clip_grad_norm_ at 5 of the NaN total norm made every gradient NaN before
    # step() checked them: said so, with the origin's parameter (replay.spread_grads)
    assert "spread word_proj.weight's NaN into them, as a clip_grad_norm_ does" \
        in rep["problems"][0], rep["problems"]
    assert o["source"] == source_line(MODELS, "torch.where(n > 0, x.sum(2) / n")
    assert "make the masked entries' input safe before the op" in rep["hint"], rep["hint"]


def test_adam_without_eps_makes_the_padding_row_and_the_absent_words_nan(tmp_path):
    # the frozen padding row and every word absent from the batch have gradients of exactly
    # 0: m / (sqrt(v) + 0) is 0/0 there at the first update
    data = M.corpus(16)
    err = event(tmp_path, "make_han", data, bce(), eps=0.0)
    assert (err.event["step"], err.event["phase"], err.event["params"]) == (
        0, "optimizer", ["emb.weight"])
    docs = M.collate(data[:BATCH])[0]
    absent = sorted(set(range(M.VOCAB)) - set(docs[docs != M.PAD].tolist()))
    rep = nanreplay_json(err.bundle_path, code=1)  # (the update is not re-run: exit 1)
    assert (rep["cause"], rep["reproduced"]) == ("optimizer", False), rep
    assert "with eps=0 an element whose gradients have all been exactly 0" in rep["hint"]
    rows = ", ".join(map(str, absent[:8]))
    assert f"it made only row(s) {rows} (+{len(absent) - 8}) of {M.VOCAB} of emb.weight" \
        in rep["hint"], rep["hint"]
