"""Sequence labelling with a CRF layer as NER and POS-tagging code writes it
(``crf_tagging_models``: a BiLSTM under pytorch-crf's ``torchcrf.CRF`` or a hand-written CRF,
a tiny ``transformers`` BertModel with word-piece alignment, labels -100 on the subwords,
gradient clipping, a linear warmup schedule, Viterbi / ``crf.decode`` evaluation), each with a
failure such code really meets: the recorder fires at the planted step and ``nanreplay --json``
names the module, op, samples and cause."""

from __future__ import annotations

import crf_tagging_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line
from torch.utils.data import DataLoader

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

MODELS = "crf_tagging_models.py"
FACTORY = "crf_tagging_models:make_tagger"


def fit(model, opt, loss_fn, ds, epochs=1):
    """The tagger's loop: NLL of the CRF, clipping, Adam; ``crf.decode`` / Viterbi on a
    validation batch after each epoch. Returns the losses."""
    losses = []
    for _ in range(epochs):
        model.train()
        for words, tags, mask in DataLoader(ds, batch_size=8, collate_fn=M.collate):
            opt.zero_grad()
            loss = loss_fn(model(words, mask, tags), mask)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            losses.append(loss.detach())
        model.eval()
        with torch.no_grad():
            words, _, mask = M.collate([M.Sentences(8, seed=1)[i] for i in range(8)])
            model(words, mask)
    return losses


def run(tmp_path, ds, loss_fn=M.crf_nll, **kw):
    """One epoch under the recorder; the NonFiniteError it raised."""
    model = M.make_tagger(**kw)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=tmp_path, factory=FACTORY,
                            factory_kwargs=kw) as rec:
            fit(model, opt, rec.loss_fn, ds)
    return info.value


def origin(rep):
    o = rep["origin"]
    return o["phase"], o["module"], o["op"], o["samples"], rep["cause"]


def test_healthy_bilstm_crf_raises_nothing_and_trains_bit_identically(tmp_path):
    """pytorch-crf's CRF under a BiLSTM, two epochs with decoding, with and without the
    recorder: no event, and every loss and weight equal to the bit."""
    runs = []
    for recorded in (False, True):
        model = M.make_tagger()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        if recorded:
            with FlightRecorder(model, opt, loss_fn=M.crf_nll, out_dir=tmp_path,
                                factory=FACTORY) as rec:
                losses = fit(model, opt, rec.loss_fn, M.Sentences(), epochs=2)
        else:
            losses = fit(model, opt, M.crf_nll, M.Sentences(), epochs=2)
        runs.append((torch.stack(losses), model.state_dict()))
    assert torch.equal(runs[0][0], runs[1][0])
    assert all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in runs[0][1])
    assert not list(tmp_path.glob("*.nan"))


def test_healthy_bert_crf_with_wordpiece_alignment_and_warmup_raises_nothing(tmp_path):
    """A BertModel built from a config, labels -100 on [CLS], [SEP] and later word pieces, the
    CRF over each word's first piece, a linear warmup schedule and clipping: no event."""
    from transformers import get_linear_schedule_with_warmup

    model = M.make_bert_crf()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    sched = get_linear_schedule_with_warmup(opt, 2, 16)
    with FlightRecorder(model, opt, out_dir=tmp_path, factory="crf_tagging_models:make_bert_crf"):
        for _ in range(2):
            for ids, att, labels, first in DataLoader(M.Sentences(), batch_size=8,
                                                      collate_fn=M.bert_collate):
                opt.zero_grad()
                model(ids, att, labels, first).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
    assert not list(tmp_path.glob("*.nan"))


def test_an_empty_sentence_under_a_per_token_nll_is_named_as_a_length_of_0(tmp_path):
    """A blank line of the CoNLL file read as a sentence of no words (sentence 21: batch 2,
    row 5): its mask is all padding, and the per-token NLL divides its log-likelihood by its
    length 0."""
    e = run(tmp_path, M.Sentences(empty=(21,)), M.per_token_nll, crf="logsumexp")
    assert (e.event["step"], e.event["phase"], e.event["kind"]) == (2, "loss", "+inf")
    rep = nanreplay_json(e.bundle_path)
    assert origin(rep) == ("loss", "<loss>", "aten.div", [5], "invalid"), rep
    assert rep["origin"]["source"] == source_line(MODELS, "-(llh / mask.sum(1)).mean()")
    assert "a length of 0" in rep["hint"], rep["hint"]


def test_a_naive_log_sum_exp_forward_algorithm_overflows_on_a_long_sentence(tmp_path):
    """The forward algorithm written ``log(sum(exp(...)))``: alpha grows with the sentence's
    length, and a sentence of 90 words (37: batch 4, row 5) makes the sum of finite exps
    overflow. The hint said the op's earlier calls grew call after call, 'the iterates of a
    loop were diverging ... make the iteration converge' (and then the line's loop's time
    steps): alpha's growth is the sequence's, not a divergence; it now says a hand-written
    log-sum-exp whose sum overflowed, and torch.logsumexp."""
    e = run(tmp_path, M.Sentences(long=(37,)), crf="naive")
    assert (e.event["step"], e.event["module"]) == (4, "crf")
    rep = nanreplay_json(e.bundle_path)
    assert origin(rep) == ("forward", "crf", "aten.sum", [5], "overflow"), rep
    assert rep["origin"]["source"] == source_line(
        MODELS, "nxt = torch.log(torch.sum(torch.exp(nxt), dim=1))")
    assert "a hand-written log-sum-exp" in rep["hint"], rep["hint"]
    assert "torch.logsumexp(x, dim)" in rep["hint"], rep["hint"]
    assert "diverging" not in rep["hint"] + " ".join(rep["problems"]), rep


def test_a_probability_space_forward_algorithm_underflows_to_log_0(tmp_path):
    """An HMM-style CRF (log-softmax emissions and transitions) whose forward algorithm keeps
    alpha as probabilities, ``(alpha @ exp(T)) * exp(e_t)`` under ``torch.where`` over the
    padding: over 90 words (37: batch 4, row 5) it falls below float32's smallest number and
    the final log takes 0. The hint gave the general log-space list; the running product
    through the matrix product and the ``where`` is now followed to the log, and the hint
    says a product kept running in a loop (an HMM's unscaled forward pass) underflowed."""
    e = run(tmp_path, M.Sentences(long=(37,)), crf="prob", log_softmax=True)
    assert (e.event["step"], e.event["module"]) == (4, "crf")
    rep = nanreplay_json(e.bundle_path)
    assert origin(rep) == ("forward", "crf", "aten.log", [5], "underflow"), rep
    assert "kept running in a loop" in rep["hint"], rep["hint"]
    assert "an HMM's unscaled forward pass) that underflowed" in rep["hint"], rep["hint"]


def test_padding_emissions_at_minus_inf_make_pytorch_crf_multiply_inf_by_0(tmp_path):
    """Padding's emissions filled with -inf before pytorch-crf: its gold score multiplies
    each step's emission by the mask, -inf * 0 at the first padded position (the shortest
    sentence, row 4, at step 0)."""
    e = run(tmp_path, M.Sentences(), pad_emissions=True)
    assert (e.event["step"], e.event["phase"], e.event["kind"]) == (0, "forward", "nan")
    rep = nanreplay_json(e.bundle_path)
    assert origin(rep) == ("forward", "crf", "aten.mul", [4], "invalid"), rep
    assert rep["origin"]["chain"][0]["op"] == "aten.masked_fill", rep["origin"]
    assert "instead of -inf" in rep["hint"], rep["hint"]


def test_padding_emissions_at_minus_inf_are_a_backward_nan_of_a_hand_written_crf(tmp_path):
    """The same -inf padding under a hand-written CRF whose gold score picks with
    ``torch.where``: the forward is finite, but the forward algorithm's logsumexp over a
    padded step's all -inf scores has the derivative exp(-inf + inf) = NaN for every
    sentence with padding (all but row 5, the longest)."""
    e = run(tmp_path, M.Sentences(), crf="logsumexp", pad_emissions=True)
    assert (e.event["step"], e.event["phase"]) == (0, "backward")
    rep = nanreplay_json(e.bundle_path)
    assert origin(rep) == ("backward", "crf", "LogsumexpBackward0", [0, 1, 2, 3, 4, 6, 7],
                           "invalid"), rep
    assert "instead of -inf" in rep["hint"], rep["hint"]


def test_bio_constraints_written_as_minus_inf_into_pytorch_crf_say_where_a_mask_belongs(tmp_path):
    """The BIO constraints written into pytorch-crf's trained ``transitions`` and
    ``start_transitions`` as -inf after the model was built (with -1e4 the run is healthy):
    a weights event at step 0. The hint said the weights came in so 'with the state_dict
    loaded before (a checkpoint, a model soup, a TIES merge...)' and 'as an element-wise
    division makes where its divisor is 0': they hold -inf and nothing else, a mask value,
    and the hint now says so and where a mask belongs."""
    for value in (-1e4, float("-inf")):
        model = M.make_tagger()
        M.forbid_bio(model.crf, value)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        try:
            with FlightRecorder(model, opt, loss_fn=M.crf_nll, out_dir=tmp_path,
                                factory=FACTORY) as rec:
                fit(model, opt, rec.loss_fn, M.Sentences())
        except NonFiniteError as err:
            e = err
        else:
            assert value == -1e4 and not list(tmp_path.glob("*.nan"))
    assert (e.event["step"], e.event["phase"], e.event["kind"]) == (0, "weights", "-inf")
    rep = nanreplay_json(e.bundle_path)
    assert (rep["origin"]["phase"], rep["cause"]) == ("weights", "weights"), rep
    assert "they were -inf, and only -inf, at the first step" in rep["hint"], rep["hint"]
    assert "masked_fill(~allowed, -inf)" in rep["hint"], rep["hint"]
    assert "TIES" not in rep["hint"], rep["hint"]
