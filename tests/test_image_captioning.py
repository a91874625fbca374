"""End to end: image captioning as Show-Attend-Tell and self-critical sequence training write
it (``image_captioning_models``: a CNN encoder's annotation grid, an LSTM decoder with soft
attention and its gating scalar, teacher-forced label-smoothed cross-entropy plus the doubly
stochastic attention regulariser under bf16 autocast, gradient clipping and Adam with a linear
warmup; then SCST: K sampled captions per image, a CIDEr-like reward with log-IDF weights from
the training corpus' document frequencies, the mean of the other samples as the baseline, an
entropy bonus), trained under the recorder from a DataLoader until a planted bug of the domain
fires, then replayed with the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import image_captioning_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line
from torch.utils.data import DataLoader, TensorDataset

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

BATCH, K = 32, 4


def line_of(text: str) -> str:
    return source_line("image_captioning_models.py", text)


def loader(x, caps) -> DataLoader:
    return DataLoader(TensorDataset(x, caps), batch_size=BATCH)


def xe_epoch(model, opt, loss, data, rec=None, sched=None) -> list[float]:
    """Teacher forcing under bf16 autocast, clipped gradients, a warmup schedule."""
    call = rec.loss_fn if rec is not None else loss
    losses = []
    for x, tok in data:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits, alphas = model(x, tok, (tok != M.PAD).float())
        value = call(logits.float(), alphas.float(), tok)
        value.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(float(value.detach()))
    return losses


def scst_epoch(model, opt, loss, data, rec=None, temperature=1.0) -> list[float]:
    """K captions sampled per image (no grad), then their log-probs re-scored with grad."""
    call = rec.loss_fn if rec is not None else loss
    g, losses = torch.Generator().manual_seed(0), []
    for x, tok in data:
        xs, refs = x.repeat_interleave(K, 0), tok.repeat_interleave(K, 0)
        model.eval()
        sampled = model.sample(xs, temperature=temperature, generator=g)
        model.train()
        opt.zero_grad()
        logits, _ = model(xs, sampled, (sampled != M.PAD).float())
        value = call(logits, sampled, refs)
        value.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(value.detach()))
    return losses


def corpus(edit=None):
    x, cls = M.images()
    caps = M.captions(cls)
    if edit is not None:
        edit(x)
    return x, caps


def xe_run(tmp_path: Path, x, caps, factory="make_model", recorded=True, epochs=1, eps=1e-8):
    model = getattr(M, factory)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=eps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    loss, data = M.CaptionLoss(), loader(x, caps)
    if not recorded:
        return [xe_epoch(model, opt, loss, data, sched=sched) for _ in range(epochs)], model
    with FlightRecorder(model, opt, loss_fn=loss, out_dir=tmp_path,
                        factory=f"image_captioning_models:{factory}") as rec:
        return [xe_epoch(model, opt, loss, data, rec, sched) for _ in range(epochs)], model


def pretrained(x, caps, epochs: int) -> M.ShowAttendTell:
    """The XE stage SCST starts from (lr 1e-2, unrecorded)."""
    model = M.make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(epochs):
        xe_epoch(model, opt, M.CaptionLoss(), loader(x, caps))
    return model


def scst_run(tmp_path: Path, x, caps, recorded=True, pretrain=0, temperature=1.0, **kw):
    model = pretrained(x, caps, pretrain)
    opt = torch.optim.Adam(model.parameters(), lr=5e-5)
    loss = M.SCSTLoss(*M.document_frequency(caps), n_docs=len(caps), k=K,
                      temperature=temperature, **kw)
    if not recorded:
        return scst_epoch(model, opt, loss, loader(x, caps), temperature=temperature), model
    with FlightRecorder(model, opt, loss_fn=loss, out_dir=tmp_path,
                        factory="image_captioning_models:make_model") as rec:
        return scst_epoch(model, opt, loss, loader(x, caps), rec, temperature), model


def fire(run, *args, **kw) -> NonFiniteError:
    with pytest.raises(NonFiniteError) as info:
        run(*args, **kw)
    return info.value


def report(err: NonFiniteError, step: int, phase: str, reproduced=True) -> tuple[dict, dict]:
    assert (err.event["step"], err.event["phase"]) == (step, phase), err.event
    rep = nanreplay_json(err.bundle_path, code=0 if reproduced else 1)
    assert rep["reproduced"] is reproduced, json.dumps(rep, indent=1)
    return rep, rep["origin"]


def params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("stage", ["xe", "scst"])
def test_healthy_captioner_raises_nothing_and_trains_bit_identically(tmp_path, stage):
    x, caps = corpus()
    runs = []
    for recorded in (False, True):
        if stage == "xe":
            losses, model = xe_run(tmp_path, x, caps, recorded=recorded, epochs=2)
        else:
            losses, model = scst_run(tmp_path, x, caps, recorded=recorded, pretrain=1)
        runs.append((losses, params(model)))
    (plain, w0), (watched, w1) = runs
    assert plain == watched
    assert all(torch.equal(a, b) for a, b in zip(w0, w1))
    assert not list(tmp_path.glob("*.nan"))
    assert M.make_model().beam_search(x[:2]).shape == (2, M.MAXLEN)


def test_a_corrupt_image_with_nan_pixels_is_named_as_input_at_its_row(tmp_path):
    """Image 37 (row 5 of the second batch) decoded with a NaN patch."""
    x, caps = corpus(lambda x: x[37, :, 4:8, 4:8].fill_(float("nan")))
    err = fire(xe_run, tmp_path, x, caps)
    rep, o = report(err, 1, "input")
    assert (o["samples"], o["made"], rep["cause"]) == ([5], "nan", "input"), rep
    assert "the batch itself holds NaN/Inf" in rep["hint"], rep["hint"]


def test_a_16_bit_image_never_scaled_overflows_a_hand_written_attention_softmax(tmp_path):
    """Image 40 (row 8 of the second batch) read as uint16 (0..65535) without the division
    by 65535: its attention scores reach ~1e3 and ``exp(e) / exp(e).sum()`` overflows."""
    x, caps = corpus(lambda x: x[40].mul_(65535).round_())
    err = fire(xe_run, tmp_path, x, caps, "make_manual_softmax_model")
    rep, o = report(err, 1, "forward")
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == (
        "attend", "aten.exp", "+inf", [8], "overflow"), json.dumps(rep, indent=1)
    assert o["source"] == line_of("alpha = torch.exp(e) / torch.exp(e).sum(-1, keepdim=True)")
    assert "a softmax written by hand" in rep["hint"], rep["hint"]
    assert "the data of these samples is out of scale" in rep["hint"], rep["hint"]


def test_a_hand_written_feature_norm_at_black_images_is_nan_in_backward_only(tmp_path):
    """Letterbox-black images 37 and 45 have all-zero annotation vectors:
    ``f / sqrt(sum f^2).clamp_min(1e-6)`` is 0 forward, but sqrt's derivative at 0 times the
    clamp's zero gradient is NaN in backward."""
    x, caps = corpus(lambda x: (x[37].zero_(), x[45].zero_()))
    err = fire(xe_run, tmp_path, x, caps, "make_l2norm_model")
    rep, o = report(err, 1, "backward")
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == (
        "encoder", "SqrtBackward0", "nan", [5, 13], "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == line_of("f = f / torch.sqrt((f ** 2).sum(-1, keepdim=True))")
    assert "torch.linalg.vector_norm" in rep["hint"], rep["hint"]


def test_adam_with_eps_0_makes_unused_weights_0_over_0(tmp_path):
    """eps=0: an element whose gradient is exactly 0 (the embedding rows of words no caption
    of the batch holds) has m = v = 0 and Adam's m / (sqrt(v) + eps) is 0/0."""
    err = fire(xe_run, tmp_path, *corpus(), eps=0.0)
    rep, _ = report(err, 0, "optimizer", reproduced=False)
    assert "embed.weight" in err.event["params"]
    assert rep["cause"] == "optimizer", json.dumps(rep, indent=1)
    assert "with eps=0 an element whose gradients have all been exactly 0" in rep["hint"]


def test_cider_document_frequencies_without_their_floor_take_log_of_0(tmp_path):
    """CIDEr's ``log(max(1, df))`` written with the floor 0: a 2-gram no training caption
    holds has df 0, log(0) = -inf, its idf +inf."""
    err = fire(scst_run, tmp_path, *corpus(), df_floor=0.0)
    rep, o = report(err, 0, "loss")
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == (
        "<loss>", "aten.log", "-inf", [], "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == line_of("torch.log(df.clamp_min(self.df_floor))")
    assert "the floor that input is clamped to is exactly 0" in rep["hint"], rep["hint"]


def test_a_sampled_caption_that_is_only_eos_has_no_token_to_average(tmp_path):
    """The length mask written without <eos>: a caption sampled as ``<bos> <eos>`` keeps no
    token, and the length-normalised log-probability is 0/0 at exactly those samples."""
    x, caps = corpus()
    model = M.make_model().eval()
    g = torch.Generator().manual_seed(0)
    sampled = model.sample(x[:BATCH].repeat_interleave(K, 0), generator=g)
    empty = (sampled[:, 1] == M.EOS).nonzero().flatten().tolist()
    assert 0 < len(empty) < BATCH * K
    err = fire(scst_run, tmp_path, x, caps, count_eos=False)
    rep, o = report(err, 0, "loss")
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == (
        "<loss>", "aten.div", "nan", empty, "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == line_of("seq_logp = (logp * keep).sum(1) / keep.sum(1)")
    assert "they have no valid entry" in rep["hint"], rep["hint"]


def test_an_entropy_bonus_at_a_low_temperature_underflows_at_padded_positions(tmp_path):
    """After the XE stage the decoder is confident; ``softmax(logits / 0.05)`` rounds a
    word's probability to 0 (1.4e-47 in float64), and ``p * log(p)`` is 0 * -inf, at padded
    positions that ``* keep`` was meant to drop: NaN all the same. The hint said to compute
    in log space but not that every such 0 sits where the mask drops the term (so masking by a
    product cannot help); it now names that product."""
    x, caps = corpus()
    model = pretrained(x, caps, 8).eval()
    xs = x[:BATCH].repeat_interleave(K, 0)
    sampled = model.sample(xs, temperature=0.05, generator=torch.Generator().manual_seed(0))
    p = (model.train()(xs, sampled, (sampled != M.PAD).float())[0] / 0.05).softmax(-1)
    rows = (p == 0).any(-1).any(-1).nonzero().flatten().tolist()
    assert 0 < len(rows) < BATCH * K
    err = fire(scst_run, tmp_path, x, caps, pretrain=8, temperature=0.05)
    rep, o = report(err, 0, "loss")
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == (
        "<loss>", "aten.log", "-inf", rows, "underflow"), json.dumps(rep, indent=1)
    assert o["source"] == line_of("ent = (-(p * torch.log(p)).sum(-1) * keep)")
    assert "log_softmax instead of log(softmax)" in rep["hint"], rep["hint"]
    assert "then multiplied by a mask's 0 in aten.mul (" + line_of(
        "ent = (-(p * torch.log(p)).sum(-1) * keep)") + "): the 0 is reached only in entries " \
        "the loss leaves out" in rep["hint"], rep["hint"]
