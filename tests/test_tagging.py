"""Sequence labelling trained as NLP practitioners write it (``tagging_models``: a BiLSTM-CRF
NER tagger over word embeddings and a character CNN, packed sequences, a CRF whose forward
algorithm runs ``logsumexp`` over a padding mask with BIO constraints, a token classifier with
labels -100), each with a planted bug: the recorder fires at the planted step and
``nanreplay --json`` names the module, op, samples and cause."""

from __future__ import annotations

from pathlib import Path

import pytest
import tagging_models as T
import torch
from bundles import nanreplay_json
from torch.utils.data import DataLoader

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def train_tagger(model, ds, tmp_path, factory, epochs=1, **kw):
    """The tagger's loop: Adam, gradient clipping, Viterbi decoding of a validation set after
    each epoch; returns the recorder's NonFiniteError, or None after a clean run."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    val = T.Sentences(16, seed=1)
    try:
        with FlightRecorder(model, opt, out_dir=tmp_path, factory=factory if ":" in factory else f"tagging_models:{factory}",
                            **kw):
            for _ in range(epochs):
                model.train()
                for words, chars, lengths, tags in DataLoader(ds, batch_size=16,
                                                              collate_fn=T.collate):
                    opt.zero_grad()
                    model(words, chars, lengths, tags).backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                    opt.step()
                model.eval()
                with torch.no_grad():
                    for words, chars, lengths, _ in DataLoader(val, batch_size=8,
                                                               collate_fn=T.collate):
                        model(words, chars, lengths)
    except NonFiniteError as e:
        return e
    return None


def test_a_healthy_bilstm_crf_with_bio_constraints_and_viterbi_raises_nothing(tmp_path):
    """-inf constraints masked into the transitions in forward, logsumexp over them, Viterbi
    in eval: intended infinities that never reach the loss."""
    assert train_tagger(T.make_tagger(), T.Sentences(), tmp_path, "make_tagger", epochs=2) is None


def test_an_iob1_sentence_under_bio_constraints_names_its_sample(tmp_path):
    """A BIO-constrained CRF (illegal transitions masked to -inf, AllenNLP style) trained on
    data with one IOB1 sentence, whose entity starts with I-PER: its gold path takes the
    masked start transition, its score is -inf and the batch's NLL +inf. The replay named
    the mean that folded that +inf in, but no sample (the mean is 0-d): the samples are now
    the rows of the infinity the mean folded in, sentence 40 (row 8 of batch 2), and
    dropping it makes the step finite."""
    e = train_tagger(T.make_tagger(), T.Sentences(iob1=(40,)), tmp_path, "make_tagger")
    assert e is not None
    ev = e.event
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (2, "forward", "crf", "+inf")
    rep = nanreplay_json(e.bundle_path, "--try", "drop=8")
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("crf", "aten.mean", [8], "invalid"), rep
    assert o["chain"][0]["op"] == "aten.masked_fill" and o["chain"][0]["intentional"], o
    assert "a target on a masked class" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_minus_inf_written_into_trained_transitions_is_a_weights_event_at_step_0(tmp_path):
    """The tutorial CRF with its illegal transitions written as -inf into the trained
    ``transitions`` and ``start`` parameters. No weight was checked before the first update,
    so the event came after it: 'optimizer.step() made 2 parameter(s) non-finite', and the
    replay said finite gradients became non-finite weights: check the learning rate. The
    weights are now measured in the steps before the first update (usually one): a weights
    event at step 0, and the replay, building the factory's model again, says the factory
    builds them -inf and where such a constraint belongs."""
    e = train_tagger(T.make_hard_tagger(), T.Sentences(), tmp_path, "make_hard_tagger")
    assert e is not None
    ev = e.event
    assert (ev["step"], ev["phase"], ev["params"], ev["kind"]) == \
        (0, "weights", ["crf.transitions", "crf.start"], "-inf"), ev
    rep = nanreplay_json(e.bundle_path)
    assert (rep["origin"]["phase"], rep["cause"]) == ("weights", "weights"), rep
    assert rep["hint"].startswith("the factory builds crf.transitions, crf.start non-finite"), \
        rep["hint"]
    assert "masked_fill(~allowed, -inf)" in rep["hint"], rep["hint"]


def test_a_micro_batch_with_no_labelled_token_says_the_token_count_is_0(tmp_path):
    """A token classifier trained with gradient accumulation (4 micro-batches a step) and a
    loss normalised by the number of labelled tokens, ``sum / (labels != -100).sum()``; the
    third micro-batch of step 2 holds only -100 labels (sentences whose every token is a
    continuation): 0/0. The hint said to 'skip the rows where it is 0', as for a per-row
    divisor: the count is an integer tensor, which the evidence of the op's floating inputs
    left out, so its 0-d shape went unseen. It now says the divisor is one count for the
    whole batch and to divide by count.clamp_min(1)."""
    model = T.make_token_tagger()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = list(DataLoader(T.Sentences(64), batch_size=4,
                             collate_fn=lambda b: T.collate(b, label_pad=-100)))
    words, chars, lengths, tags = loader[10]  # step 2, micro-batch 2
    loader[10] = (words, chars, lengths, torch.full_like(tags, -100))
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=T.token_loss, out_dir=tmp_path,
                            factory="tagging_models:make_token_tagger") as rec:
            for k, (words, _, _, labels) in enumerate(loader):
                (rec.loss_fn(model(words), labels) / 4).backward()
                if (k + 1) % 4 == 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    opt.step()
                    opt.zero_grad()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["micro_batch"]) == (2, "loss", 2), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["op"], o["micro_batch"], o["samples"], rep["cause"]) == \
        ("aten.div", 2, [], "invalid"), rep
    assert "one 0-d value for every element" in rep["hint"], rep["hint"]
    assert "count.clamp_min(1)" in rep["hint"], rep["hint"]


def test_scheduled_sampling_raising_on_a_blank_source_line_names_its_sample(tmp_path):
    """A GRU encoder-decoder with attention over the source's padding mask, trained with
    teacher forcing and scheduled sampling (``torch.multinomial`` of the decoder's own
    distribution, inside forward), label smoothing, beam search in validation. Pair 37 of the
    corpus has a blank source line: its attention row is all -inf, softmax makes NaN, and
    the sampling draw raises on it ('probability tensor contains ...') inside the root's own
    forward. The replay named the softmax but no sample, and its cause was unknown: the
    float64 re-run raised too, before the root's call returned, and without a capture of the
    op (kept only for ops of finite inputs) it had no answer. The op's float64 values now
    answer it (a fully masked row) and the samples are those of its NaN rows: row 5 of
    step 4's batch, whose drop makes the step finite."""
    data, val = T.parallel(empty=(37,)), T.parallel(4, seed=1)
    model = T.make_seq2seq()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    crit = torch.nn.CrossEntropyLoss(ignore_index=T.PAD, label_smoothing=0.1)
    with pytest.raises(RuntimeError, match="probability tensor contains"):
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="tagging_models:make_seq2seq"):
            for src, tgt in DataLoader(data, batch_size=8, collate_fn=T.collate_pairs):
                opt.zero_grad()
                crit(model(src, tgt).flatten(0, 1), tgt[:, 1:].flatten()).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                if src.shape[0] == 8:  # (validation after each batch: beam search)
                    model.eval()
                    model.beam_search(collate_pairs_src(val))
                    model.train()
    [bundle] = tmp_path.glob("*.nan")
    rep = nanreplay_json(bundle, "--try", "auto")
    o = rep["origin"]
    assert (rep["event"]["step"], o["module"], o["op"], o["samples"], rep["cause"]) == \
        (4, "", "aten._softmax", [5], "invalid"), rep
    assert "fully masked row" in rep["hint"], rep["hint"]
    assert [(t["try"], t["finite"]) for t in rep["what_if"]] == [("drop=5", True)], rep


def collate_pairs_src(pairs):
    return T.collate_pairs(pairs)[0]


def test_a_written_out_logsumexp_over_a_tag_no_transition_enters_blames_its_max(tmp_path):
    """The tutorial CRF: START is a tag no transition may enter (masked to -inf in forward),
    and the forward algorithm's log-sum-exp is written out, ``m + log(sum(exp(x - m)))``. The
    START column is all -inf, so its max m is -inf and x - m is -inf - -inf: NaN at step 0 in
    every sentence. The replay blamed ``aten.select`` (``trans[-1]``, picking the START row
    with its -inf: smaller than the matrix, so it counted as a reduction folding the mask in)
    and told to give masked entries zero weight in the loss. Views and element picks fold
    nothing now: the max over the all -inf column is blamed, and the hint says to call
    torch.logsumexp."""
    e = train_tagger(T.make_tutorial_tagger(), T.Sentences(32), tmp_path,
                     "make_tutorial_tagger")
    assert e is not None
    ev = e.event
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (0, "forward", "crf", "nan")
    rep = nanreplay_json(e.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], o["all_samples"], rep["cause"]) == \
        ("crf", "aten.max", True, "invalid"), rep
    line = next(i for i, text in enumerate(Path(T.__file__).read_text().splitlines(), 1)
                if "m = x.max(dim=dim" in text)
    assert o["source"] == f"tagging_models.py:{line}", o["source"]
    assert "call torch.logsumexp" in rep["hint"], rep["hint"]


def test_a_step_with_no_labelled_token_says_its_python_int_count_is_0(tmp_path):
    """Gradient accumulation normalised as Hugging Face's Trainer does it: the loop counts the
    labelled tokens of the step's 4 micro-batches first, ``num_items_in_batch``, a Python int,
    and every micro-batch's summed loss is divided by it. Step 1's micro-batches hold only
    -100 labels: 0/0. The hint read the 0 as a setting ('find the setting that made it 0 (a
    drop probability of 1 ...)'); an int divisor is a count, and the hint now says so and
    gives max(count, 1)."""
    model = T.make_token_tagger()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = list(DataLoader(T.Sentences(48), batch_size=4,
                             collate_fn=lambda b: T.collate(b, label_pad=-100)))
    for k in range(4, 8):  # step 1: sentences whose every token is a continuation
        words, chars, lengths, tags = loader[k]
        loader[k] = (words, chars, lengths, torch.full_like(tags, -100))
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=T.token_loss_sum, out_dir=tmp_path,
                            factory="tagging_models:make_token_tagger") as rec:
            for s in range(0, len(loader), 4):
                group = loader[s:s + 4]
                n_items = sum(int((labels != -100).sum()) for *_, labels in group)
                for words, _, _, labels in group:
                    rec.loss_fn(model(words), labels, n_items).backward()
                opt.step()
                opt.zero_grad()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["micro_batch"]) == (1, "loss", 0), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["op"], o["samples"], rep["cause"]) == ("aten.div", [], "invalid"), rep
    assert "the divisor is a Python integer" in rep["hint"], rep["hint"]
    assert "max(count, 1)" in rep["hint"] and "drop probability" not in rep["hint"], rep["hint"]
