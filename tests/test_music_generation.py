"""End to end: symbolic music generation (``music_generation_models``: a Music Transformer with
relative attention and Transformer-XL segment memory over REMI tokens, a MusicVAE with a
conductor LSTM) trained from a DataLoader over pieces of different lengths, segments carried
with detached memory, gradient accumulation, AdamW with an inverse-sqrt warmup, clipping and
optional float16 autocast; planted bugs replayed with the CLI."""

from __future__ import annotations

import music_generation_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line
from torch.utils.data import DataLoader

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

MODELS = "music_generation_models.py"
BATCH, ACCUM = 4, 2


def train(model, data, loss_fn, out_dir=None, factory=None, amp=None, eps=1e-8, guard=False,
          collate=M.collate):
    """AdamW with the inverse-sqrt warmup, ACCUM segments per step, clipping at 1; float16
    autocast when ``amp``; under the recorder when ``out_dir`` is given."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=eps, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, M.inverse_sqrt(4))
    rec = None
    if out_dir is not None:
        rec = FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=out_dir, lr_scheduler=sched,
                             guard_optimizer=guard, factory=f"music_generation_models:{factory}").attach()
    try:
        for tok, vel, tempo in DataLoader(data, batch_size=BATCH, collate_fn=collate):
            mems = mem_pad = None
            segs = list(M.segments(tok, vel))
            for i, (x, y, v) in enumerate(segs):
                with torch.autocast("cpu", dtype=torch.float16, enabled=amp is not None):
                    logits, mu, log_sigma, new, mem_pad = model(x, tempo.to(
                        next(model.parameters()).dtype), mems, mem_pad)
                    loss = loss_fn(logits, mu, log_sigma, y, v)
                (loss / ACCUM).backward()
                mems = [m.detach() for m in new]
                if i % ACCUM == ACCUM - 1 or i == len(segs) - 1:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    opt.step()
                    sched.step()
                    opt.zero_grad()
    finally:
        if rec is not None:
            rec.detach()
    return model


def train_vae(model, data, loss_fn, out_dir=None, factory=None):
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    rec = None
    if out_dir is not None:
        rec = FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=out_dir,
                             factory=f"music_generation_models:{factory}").attach()
    try:
        for tok in DataLoader(data, batch_size=BATCH, collate_fn=M.vae_batch):
            opt.zero_grad()
            logits, mu, logvar = model(tok)
            loss_fn(logits, mu, logvar, tok).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    finally:
        if rec is not None:
            rec.detach()
    return model


def event(out_dir, factory, data, loss_fn, amp=None, eps=1e-8, guard=False) -> NonFiniteError:
    torch.manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        train(getattr(M, factory)(), data, loss_fn, out_dir, factory, amp, eps, guard)
    return info.value


def replay(err):
    rep = nanreplay_json(err.bundle_path)
    assert (rep["reproduced"], rep["problems"], rep["fidelity"]["matches"]) == (
        True, [], True), rep
    return rep, rep["origin"]


# ---------------------------------------------------------------------------------------------
# healthy


@pytest.mark.parametrize("amp", [None, torch.float16], ids=["fp32", "fp16"])
def test_segments_with_memory_raise_nothing_and_train_the_same(tmp_path, amp):
    # pieces of 1..3 bars padded to the batch's longest: later segments of the short ones are
    # padding throughout, memory included (their queries attend to themselves)
    data = M.corpus(8)
    runs = []
    for out_dir in (None, tmp_path):
        torch.manual_seed(0)
        runs.append(train(M.make_mt(), data, M.MusicLoss(), out_dir, "make_mt", amp)
                    .state_dict())
    assert not list(tmp_path.glob("*.nan"))
    for name, t in runs[0].items():
        assert torch.equal(t, runs[1][name]), name


def test_music_vae_with_free_bits_raises_nothing_and_trains_the_same(tmp_path):
    data = M.corpus(8)
    runs = []
    for out_dir in (None, tmp_path):
        torch.manual_seed(0)
        runs.append(train_vae(M.make_vae(), data, M.VAELoss(), out_dir, "make_vae").state_dict())
    assert not list(tmp_path.glob("*.nan"))
    for name, t in runs[0].items():
        assert torch.equal(t, runs[1][name]), name


# ---------------------------------------------------------------------------------------------
# planted bugs


def test_a_piece_that_ended_leaves_a_later_segment_no_key(tmp_path):
    # piece 2 (one bar) ends in segment 1; segment 3's row, memory included, is padding, and
    # every query of it is masked at every key
    err = event(tmp_path, "make_mt_unguarded", M.corpus(8), M.MusicLoss())
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (
        1, "forward", "blocks.0.attn")
    rep, o = replay(err)
    assert (rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        "invalid", "blocks.0.attn", "aten._softmax", "nan", [2]), rep
    assert o["source"] == source_line(MODELS, "attn = torch.softmax(scores, dim=-1)")
    # (was: "a blank record (a document whose text extraction gave no sentence ...) ... fix or
    # filter such records where the data is made": the piece is sound, it only ended)
    assert "blank record" not in rep["hint"], rep["hint"]
    assert "while the loop passes the model its own state back (args[2][0], args[2][1], " \
        "args[3], returned by the model the segment before)" in rep["hint"], rep["hint"]
    assert "most likely hold one that ended in an earlier segment" in rep["hint"]
    assert "let a padding query attend to its own position" in rep["hint"]


def test_a_note_on_of_velocity_zero_is_a_note_off_under_the_log_normal_loss(tmp_path):
    # MIDI's note-off as a note-on of velocity 0, kept as a note: log(0) in the velocity NLL
    err = event(tmp_path, "make_mt", M.corpus(8, zero_velocity={5}), M.MusicLoss())
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (
        3, "loss", "<loss>")
    rep, o = replay(err)
    assert (rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        "invalid", "<loss>", "aten.log", "-inf", [5 - BATCH]), rep
    assert o["source"] == source_line(MODELS, "logv = torch.log(vel)")
    # (was: "a count of 0 is an ordinary record ... take the log with a pseudo-count,
    # torch.log1p(count)" alone: a velocity of 0 is no count, and log1p would train on it)
    assert "but no value lies between 0 and 71 (the data's smallest nonzero one): if the " \
        "data is no count (a MIDI note-on of velocity 0 is the protocol's note-off" \
        in rep["hint"], rep["hint"]
    assert "re-code or filter those entries where the data is made" in rep["hint"]


def test_a_tempo_in_microseconds_per_quarter_overflows_float16(tmp_path):
    # MIDI's set_tempo value (60e6 / bpm) fed where the model expects BPM: cast to float16
    err = event(tmp_path, "make_mt", M.corpus(8, tempo_us={6}), M.MusicLoss(),
                amp=torch.float16)
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (
        3, "forward", "tempo")
    rep, o = replay(err)
    assert (rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        "overflow", "tempo", "aten._to_copy", "+inf", [6 - BATCH]), rep
    assert o["source"] == source_line(MODELS, "x = self.emb(tokens) * math.sqrt(D) + self.tempo(")
    assert "the data of these samples is out of scale (a wrong unit" in rep["hint"], rep["hint"]


def test_log_of_softmax_under_float16_underflows_at_a_token_the_prior_says_never(tmp_path):
    # the head's bias at the log unigram frequency (1e-9 for tempo tokens): softmax is 0 in
    # float16, the hand-written label smoothing's log(softmax) -inf
    err = event(tmp_path, "make_mt_prior", M.corpus(8), M.MusicLoss(by_hand=True),
                amp=torch.float16)
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (
        0, "loss", "<loss>")
    rep, o = replay(err)
    assert (rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        "underflow", "<loss>", "aten.log", "-inf", [0, 1, 2, 3]), rep
    assert o["source"] == source_line(MODELS, "logp = torch.log(F.softmax(logits, dim=-1))")
    assert "log_softmax instead of log(softmax)" in rep["hint"], rep["hint"]


def test_adamw_eps_in_a_float16_model_divides_zero_by_zero(tmp_path):
    # model.half(): eps=1e-8 is 0 in float16; the tempo tokens' embedding rows get no
    # gradient, m / (sqrt(v) + eps) is 0/0 there
    err = event(tmp_path, "make_mt_half", M.corpus(8), M.MusicLoss(), guard=True)
    assert (err.event["step"], err.event["phase"]) == (0, "optimizer")
    assert "emb.weight" in err.event["params"]
    rep, o = replay(err)
    assert (rep["cause"], o["phase"], o["op"], o["made"]) == (
        "optimizer", "optimizer", "aten.addcdiv_", "nan"), rep
    assert "eps=1e-08 is 0 in float16" in rep["hint"], rep["hint"]


def test_velocity_nll_behind_torch_where_is_nan_in_backward_only(tmp_path):
    # where(is_note, nll(vel), 0): the other positions' velocity 0 is masked in forward, but
    # (log 0 - mu)^2's backward is inf * 0
    err = event(tmp_path, "make_mt", M.corpus(8), M.MusicLoss(where=True))
    assert (err.event["step"], err.event["phase"]) == (0, "backward")
    rep, o = replay(err)
    assert (rep["cause"], o["phase"], o["module"], o["op"], o["made"], o["samples"]) == (
        "invalid", "backward", "<loss>", "PowBackward0", "nan", [0, 1, 2, 3]), rep
    assert o["source"] == source_line(MODELS, "return 0.5 * ((logv - mu) / log_sigma.exp())")
    assert "make the op's input safe before the op (torch.where(mask, x, 1))" in rep["hint"], \
        rep["hint"]


def test_a_segment_past_every_pieces_end_leaves_the_loss_no_target(tmp_path):
    # batches of pieces sorted by length, padded to a fixed MAX_LEN: the short pieces' batch
    # has a last segment of padding only; the velocity NLL's mean over no note is 0/0
    data = sorted(M.corpus(8), key=lambda p: len(p["tokens"]))
    torch.manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        train(M.make_mt(), data, M.MusicLoss(), tmp_path, "make_mt", collate=M.collate_fixed)
    err = info.value
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (
        2, "loss", "<loss>")
    rep, o = replay(err)
    assert (rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        "invalid", "<loss>", "aten.mean", "nan", []), rep
    assert o["source"] == source_line(
        MODELS, "v = lognormal_nll(vel[note], mu[note].float(), log_sigma[note].float()).mean()")
    # (was: the op's advice alone, "reduce over more than one value (a batch of 1, an empty
    # selection) ... or skip such batches", which names no data)
    assert "Here args[0], loss_args[3] and loss_args[4] are 0 everywhere in micro-batch 0 of " \
        "the step, in every sample: it is padding throughout" in rep["hint"], rep["hint"]
    assert "skip a micro-batch with no target before the loss" in rep["hint"]
