"""End to end: sequence losses written by hand (``sequence_losses_models``: a CTC alpha
recursion, a transducer lattice, ESPnet's CTC/attention hybrid with label smoothing, MWER over
an n-best list, word-level distillation), trained with Adam under ESPnet's Noam warmup and
gradient clipping until a planted bug fires, then replayed with the CLI."""

from __future__ import annotations

import pytest
import sequence_losses_models as M
import torch
from bundles import line_number, nanreplay_json
from torch.utils.data import DataLoader

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return f"sequence_losses_models.py:{line_number('sequence_losses_models.py', text)}"


def loop(out_dir, factory: str, loss_fn, batches, call, **kw):
    """Adam with ESPnet's Noam warmup and clip_grad_norm_, over ``batches``."""
    model = getattr(M, factory)()
    opt = torch.optim.Adam(model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, M.noam(M.HID, 25))
    with FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=out_dir,
                        factory=f"sequence_losses_models:{factory}", **kw) as rec:
        for b in batches:
            loss = call(rec.loss_fn, model, b)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()


def utterances(short: dict[int, int] | None = None, steps: int = 4):
    """A DataLoader of 4 utterances a batch, padded by the collate_fn; ``short``: index -> frames."""
    g = torch.Generator().manual_seed(0)
    items = [M.utterance(g, (short or {}).get(i, 6), 2 + i % 2) for i in range(4 * steps)]
    return DataLoader(items, batch_size=4, collate_fn=M.collate)


def ctc_call(fn, model, b):
    feats, feat_lens, ys, y_lens = b
    return fn(model(feats, feat_lens), ys, y_lens)


def event(out_dir, *args, **kw) -> NonFiniteError:
    with pytest.raises(NonFiniteError) as info:
        loop(out_dir, *args, **kw)
    return info.value


def test_ctc_alpha_started_at_minus_inf_asks_for_a_finite_floor_not_an_eps(tmp_path):
    # the unreachable cells of the extended-label lattice start at -inf: logaddexp(-inf, -inf)
    # is -inf, finite loss, but its derivative exp(a - result) is NaN at the first backward
    err = event(tmp_path, "make_ctc_model", M.ctc_loss, utterances(), ctc_call)
    assert (err.event["step"], err.event["phase"]) == (0, "backward")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"]) == (
        True, "invalid", "<loss>", "LogaddexpBackward0", "nan"), rep
    assert o["source"] == line_of("alpha = torch.logaddexp(torch.logaddexp(alpha, a1), a2)")
    hint = rep["hint"]
    # (was: "logaddexp at its pole ... torch.where(mask, x, 1) or add an eps": it has no pole)
    assert "-inf in both arguments" in hint and "-1e30" in hint, hint
    assert "add an eps" not in hint and "at its pole" not in hint, hint


def test_transducer_lattice_at_minus_inf_names_every_utterance_and_the_floor(tmp_path):
    # k2's "modified" transducer: cells above the diagonal (u > t) are unreachable, -inf
    def call(fn, model, b):
        feats, feat_lens, ys, y_lens = b
        return fn(model(feats, feat_lens, ys), ys, y_lens)

    err = event(tmp_path, "make_transducer", M.rnnt_modified, utterances(), call)
    assert (err.event["step"], err.event["phase"]) == (0, "backward")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["module"], o["op"], o["samples"], o["all_samples"]) == (
        "invalid", "<loss>", "LogaddexpBackward0", [0, 1, 2, 3], True), rep
    assert o["source"] == line_of("alpha = torch.logaddexp(stay, move)")
    assert "transducer lattice" in rep["hint"] and "add an eps" not in rep["hint"], rep["hint"]


def test_finite_floor_ctc_and_the_hybrid_loss_train_without_an_event(tmp_path):
    # the same recursions with -1e30 cells (and ESPnet's 0.3 * ctc + 0.7 * label-smoothed
    # attention over padded labels): no false event, though cells stay near -1e30
    loop(tmp_path, "make_ctc_model", M.ctc_loss_floor, utterances(), ctc_call)

    def hybrid(fn, model, b):
        feats, feat_lens, ys, y_lens = b
        ys_in = torch.cat([ys.new_zeros(len(ys), 1), ys[:, :-1]], 1)
        return fn(model(feats, feat_lens, ys_in), ys, y_lens, ys)

    loop(tmp_path, "make_hybrid", M.hybrid_loss, utterances(), hybrid)
    assert not list(tmp_path.glob("*.nan"))


def mwer_call(fn, model, b):
    hyps, mask, errors = b
    return fn(model(hyps, mask), errors)


def test_mwer_over_a_row_with_no_hypothesis_names_the_softmax_not_the_mean_after_it(tmp_path):
    # pruned hypotheses score +inf (allowed in the scorer's output); at step 2 utterance 1
    # has none left: softmax(-scores) over a row of -inf is NaN, and the mean word error
    # after it is 0/0 on that row too
    batches = [M.nbest_batch(s, emptied=1 if s == 2 else None) for s in range(4)]
    err = event(tmp_path, "make_nbest_scorer", M.mwer_loss, batches, mwer_call, allow_inf=[""])
    assert (err.event["step"], err.event["phase"]) == (2, "loss")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    # (was: aten.div of the mean word error, "add an eps to the denominator", which leaves
    # the softmax's NaN)
    assert (rep["cause"], o["module"], o["op"], o["samples"]) == (
        "invalid", "<loss>", "aten._softmax", [1]), rep
    assert o["source"] == line_of("post = torch.softmax(-scores, dim=-1)")
    assert "every entry is -inf" in rep["hint"] and "keep at least one" in rep["hint"], rep


def test_mwer_with_pruned_hypotheses_trains_without_an_event(tmp_path):
    loop(tmp_path, "make_nbest_scorer", M.mwer_loss, [M.nbest_batch(s) for s in range(4)],
         mwer_call, allow_inf=[""])
    assert not list(tmp_path.glob("*.nan"))


def test_distillation_from_a_sharp_teacher_is_underflow_in_its_log(tmp_path):
    # p_t * (log p_t - log p_s): at step 2 the teacher's logits are 60 times sharper, its
    # softmax underflows to 0 and 0 * log 0 is NaN in every utterance
    def call(fn, model, b):
        feats, feat_lens, _, y_lens = b
        step = call.step = getattr(call, "step", -1) + 1
        g = torch.Generator().manual_seed(step)
        teacher = torch.randn(*feats.shape[:2], M.VOCAB, generator=g) * (60.0 if step == 2 else 1)
        return fn(model(feats, feat_lens), teacher, y_lens)

    err = event(tmp_path, "make_ctc_model", M.kd_loss, utterances(), call)
    assert (err.event["step"], err.event["phase"]) == (2, "loss")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["module"], o["op"], o["made"], o["all_samples"]) == (
        "underflow", "<loss>", "aten.log", "-inf", True), rep
    assert o["source"] == line_of("kl = (p_t * (p_t.log() - log_probs)).sum(-1)")
    assert "log_softmax" in rep["hint"] and "log_target=True" in rep["hint"], rep["hint"]
