"""End to end on emotion recognition (``affective_computing_models``): a multimodal transformer
over audio, face and text features with cross-modal attention and key padding masks, trained
on padded utterance batches from a DataLoader with a loss wrapper (per-batch CCC on
valence/arousal, KL to the annotators' soft labels, an evidential NLL), a Pearson loss, Adam,
gradient clipping, and fp16 autocast with a GradScaler. Each planted failure of the domain
fires under the recorder and is replayed with the CLI; the healthy version raises no event and
trains bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import affective_computing_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("affective_computing_models.py", text)


def train(loss, out_dir, plant=None, make: str = "make_model", n: int = 16, steps: int = 5,
          record: bool = True, fp16: bool = False, half: bool = False, lr: float = 1e-3):
    """Adam, clipping at 1, over a DataLoader of 4 padded utterances a batch (one epoch);
    ``plant(data)`` breaks the data set up (an utterance's features or votes); ``fp16``:
    autocast to float16 with a GradScaler; ``half``: the whole model cast to float16."""
    model = getattr(M, make)()
    if half:
        model.half()
    data = M.utterances(n)
    if plant is not None:
        plant(data)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler("cpu", enabled=fp16)
    loader = torch.utils.data.DataLoader(data, batch_size=4, collate_fn=M.collate)
    rec = FlightRecorder(model, opt, loss_fn=loss, out_dir=out_dir, scaler=scaler if fp16
                         else None, factory=f"affective_computing_models:{make}") \
        if record else None
    losses = []
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else loss
        for k, b in enumerate(loader):
            if k == steps:
                break
            opt.zero_grad()
            feats = [b[m].half() if half else b[m] for m in ("audio", "face", "text")]
            with torch.autocast("cpu", torch.float16, enabled=fp16):
                out = model(*feats, b["a_pad"], b["f_pad"], b["t_pad"], b["speaker"])
                value = loss_fn(out, b["va"], b["votes"])
            scaler.scale(value).backward()
            losses.append(value.item())
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
    return model, losses


def fire(loss, tmp_path, plant=None, **kw):
    with pytest.raises(NonFiniteError) as info:
        train(loss, tmp_path, plant, **kw)
    return info.value.event, info.value.bundle_path


def test_healthy_runs_raise_nothing_and_train_the_same(tmp_path):
    """The loss wrapper (CCC, KL to the soft labels with F.kl_div, the evidential NLL in
    float32), in float32 and under fp16 autocast with a GradScaler: no event, bit-identical
    weights and losses with and without the recorder."""
    for fp16 in (False, True):
        recorded, losses = train(M.MultiTaskLoss(), tmp_path, fp16=fp16, steps=3)
        plain, plain_losses = train(M.MultiTaskLoss(), tmp_path, fp16=fp16, steps=3,
                                    record=False)
        assert not list(tmp_path.glob("*.nan"))
        assert losses == plain_losses and len(losses) == 3, losses
        for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
            assert torch.equal(a, b), name


def test_utterance_with_no_face_track_names_the_cross_modal_softmax_and_the_utterance(
        tmp_path):
    """Utterance 6's face detector found no face: its face track has no frame, so the collate
    pads it to nothing but padding and the audio-to-face attention's key_padding_mask masks
    every key of it: softmax over all -inf is NaN. The replay names the softmax in a2f.attn at
    step 1, that utterance (row 2), the fully masked mask and the blank face input."""
    def no_face(data):
        data[6]["face"] = torch.zeros(0, M.FACE)
    ev, bundle = fire(M.MultiTaskLoss(), tmp_path, no_face)
    assert (ev["step"], ev["phase"], ev["module"]) == (1, "forward", "a2f.attn"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "a2f.attn", "aten._softmax", "nan", [2]), o
    assert o["source"] == line_of("out, _ = self.attn(q, kv, kv, key_padding_mask=kv_pad)"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "key_padding_mask is True (masked) at every position of samples [2]" in rep["hint"]
    assert "args[1] is 0 everywhere in sample(s) 2" in rep["hint"], rep["hint"]


def test_utterance_with_no_audio_frame_names_the_pooling_division_and_its_padding_mask(
        tmp_path):
    """Utterance 5's audio was cut to nothing by voice activity detection: its
    key_padding_mask row is True everywhere, so the masked mean pooling over its audio frames
    divides 0 by 0 at step 1. The replay names the division in the root module, that
    utterance (row 1) and now the padding mask set at its every position (before: only the
    op's eps advice)."""
    def no_audio(data):
        data[5]["audio"] = torch.zeros(0, M.AUDIO)
    ev, bundle = fire(M.MultiTaskLoss(), tmp_path, no_audio)
    assert (ev["step"], ev["phase"], ev["module"]) == (1, "forward", ""), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "", "aten.div", "nan", [1]), o
    assert o["source"] == line_of("pooled = (h * keep).sum(1) / keep.sum(1)"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]
    assert "Sample(s) 1 are empty records: args[3] (a padding mask, True at the padding) is " \
        "set at every position of their rows" in rep["hint"], rep["hint"]
    assert "--try drop=1" in rep["hint"], rep["hint"]


def test_nan_word_vector_of_an_oov_word_names_the_token_by_the_text_padding_mask(tmp_path):
    """Utterance 7's third word is out of the word-embedding table's vocabulary and its
    lookup gave a NaN vector: the batch holds NaN at step 1 in one token of sample 3. The
    replay names the input, that utterance, and now the token as one corrupt element of the
    padded sequence by the text's padding mask (True at the padding), not a channel's
    standardisation by its own std (the face mask, of the same shape, is not named)."""
    def oov_word(data):
        data[7]["text"][2] = float("nan")
    ev, bundle = fire(M.MultiTaskLoss(), tmp_path, oov_word)
    assert (ev["step"], ev["phase"]) == (1, "input"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["phase"], o["made"], o["samples"]) == (
        True, "input", "nan", [3]), o
    assert rep["cause"] == "input", rep["cause"]
    assert "holds it in whole elements of its padded sets, each a real element by args[5] " \
        "(its False/0 entries; it is True at the padding" in rep["hint"], rep["hint"]
    assert "sample 3 at index 2 of dim 1" in rep["hint"], rep["hint"]
    assert "standardisation of each channel" not in rep["hint"], rep["hint"]


def test_utterance_no_annotator_labelled_names_the_soft_label_division_not_the_padding(
        tmp_path):
    """Utterance 9 has no annotator vote (every rater skipped it): label-distribution
    learning's ``votes / votes.sum()`` is 0/0 there. The replay names the division on the soft
    label line at step 2, that utterance (row 1) and the all-zero votes (the loss's third
    argument). Before, it also called the utterance an empty record because the audio and text
    padding masks (True at the padding) have no entry set in its row: it is the batch's
    longest utterance, not an empty one."""
    def no_votes(data):
        data[9]["votes"].zero_()
    ev, bundle = fire(M.MultiTaskLoss(kl=M.kl_div_soft), tmp_path, no_votes)
    assert (ev["step"], ev["phase"]) == (2, "loss"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "<loss>", "aten.div", "nan", [1]), o
    assert o["source"] == line_of("return votes / votes.sum(-1, keepdim=True)"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]
    assert "loss_args[2] is 0 everywhere in sample(s) 1" in rep["hint"], rep["hint"]
    assert "empty records" not in rep["hint"] and "args[3]" not in rep["hint"], rep["hint"]


def test_hand_written_kl_to_soft_labels_names_the_log_of_zero_and_xlogy(tmp_path):
    """KL to the annotators' distribution written as ``p * (log(p) - log q)``: an emotion no
    annotator chose has p = 0, log(0) = -inf, times 0 is NaN, at the first step in every
    utterance. The replay names the log on the KL line, all rows, and xlogy."""
    ev, bundle = fire(M.MultiTaskLoss(kl=M.kl_soft), tmp_path)
    assert (ev["step"], ev["phase"]) == (0, "loss"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "<loss>", "aten.log", "-inf", [0, 1, 2, 3]), o
    assert o["source"] == line_of("return (p * (torch.log(p) - logq)).sum(-1).mean()"), o
    assert rep["cause"] == "invalid" and "xlogy" in rep["hint"], rep["hint"]


def test_pearson_loss_on_a_last_batch_of_one_names_the_sqrt_backward_and_the_batch(tmp_path):
    """13 utterances in batches of 4: the last batch holds one. The Pearson loss with its eps
    after the roots, ``cov / (sqrt(vx) * sqrt(vy) + 1e-8)``, is finite there (0), but vx is 0
    and sqrt's derivative at 0 is infinite: NaN in the backward only, at step 3. The replay
    names SqrtBackward0 in the loss, and now that the loss's gradient is finite beside a
    second, different sample but not on copies of this one: the batch of one, drop_last."""
    ev, bundle = fire(M.pearson_loss, tmp_path, n=13)
    assert (ev["step"], ev["phase"]) == (3, "backward"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "<loss>", "SqrtBackward0", "nan", [0]), o
    assert o["source"] == line_of("r = (xc * yc).mean(0) / (torch.sqrt(vx)"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "the loss's gradient is finite beside a second, different sample" in rep["hint"]
    assert "drop_last=True" in rep["hint"], rep["hint"]


def test_pearson_from_batch_stds_on_a_last_batch_of_one_names_the_division_and_the_batch(
        tmp_path):
    """The same last batch of one under ``cov / (x.std(0) * y.std(0))``: 0/0 in the forward.
    The replay names the division in the loss and, as the loss is NaN on that utterance given
    twice too, the second sample that makes it finite: the batch's size."""
    ev, bundle = fire(M.pearson_loss_std, tmp_path, n=13)
    assert (ev["step"], ev["phase"]) == (3, "loss"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    # (the quotient is a statistic over the batch, (2,): it has no sample dimension)
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "<loss>", "aten.div", "nan", []), o
    assert o["source"] == line_of("r = cov / (x.std(0, unbiased=False)"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]
    assert "the loss is finite beside a second, different sample" in rep["hint"], rep["hint"]


def test_raw_energy_audio_under_fp16_names_the_input_cast_and_the_utterance(tmp_path):
    """Utterance 10's audio features were exported as raw filterbank energies, not log-mel
    (up to 3e5): fp16 autocast's cast of proj_a's input overflows float16 at step 2. The replay
    names the cast in proj_a, that utterance (row 2), overflow and its out-of-scale data."""
    def raw_energy(data):
        data[10]["audio"] = data[10]["audio"].exp() * 3e4
    ev, bundle = fire(M.MultiTaskLoss(), tmp_path, raw_energy, fp16=True)
    assert (ev["step"], ev["phase"], ev["module"]) == (2, "forward", "proj_a"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "proj_a", "aten._to_copy", "+inf", [2]), o
    assert rep["cause"] == "overflow" and "out of scale" in rep["hint"], rep["hint"]
    assert "--try drop=2" in rep["hint"], rep["hint"]


def test_evidential_nu_underflowed_in_fp16_names_the_reciprocal_and_float32(tmp_path):
    """The evidential head started at almost no virtual observations (nu's bias -20) and its
    NLL computed under fp16 autocast: softplus(-20) = 2e-9 is 0 in float16, and
    ``log(pi / nu)`` divides by it at the first step. The replay names the reciprocal in the
    loss, every utterance, underflow and float32."""
    ev, bundle = fire(M.MultiTaskLoss(ev_float=False), tmp_path, fp16=True,
                      make="make_low_evidence_model")
    assert (ev["step"], ev["phase"], ev["kind"]) == (0, "loss", "+inf"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "<loss>", "aten.reciprocal", "+inf", [0, 1, 2, 3]), o
    assert o["source"] == line_of("return (0.5 * torch.log(math.pi / nu)"), o
    assert rep["cause"] == "underflow" and "float32" in rep["hint"], rep["hint"]


def test_pearson_from_raw_moments_of_collapsed_predictions_names_the_sqrt_and_precision(
        tmp_path):
    """A collapsed valence/arousal head (weights 1e-6 of their start, bias 0.7) predicts
    nearly the same value for every utterance; the one-pass Pearson's ``E[x^2] - E[x]^2``
    cancels to a small negative number in float32 and its sqrt is NaN at the first step. The
    replay names the sqrt on that line, precision, and the stable variance."""
    ev, bundle = fire(M.pearson_loss_moments, tmp_path, make="make_collapsed_model")
    assert (ev["step"], ev["phase"]) == (0, "loss"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"]) == (
        True, "<loss>", "aten.sqrt", "nan"), o
    assert o["source"] == line_of("sx = torch.sqrt((x ** 2).mean(0) - x.mean(0) ** 2)"), o
    assert rep["cause"] == "precision" and "catastrophic cancellation" in rep["hint"], rep["hint"]


def test_nan_row_of_a_loaded_checkpoint_names_the_weights_and_the_checkpoint(tmp_path):
    """Fine-tuning from a text encoder checkpoint whose run had diverged: a row of proj_t's
    weight is NaN from the start. The replay names the weights in proj_t, every utterance,
    the row, and now the loaded values (before: an intended -inf mask's advice, which a NaN
    never is)."""
    ev, bundle = fire(M.MultiTaskLoss(), tmp_path, make="make_from_broken_checkpoint")
    assert (ev["step"], ev["phase"]) == (0, "weights"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["samples"]) == (
        True, "proj_t", "aten.addmm", [0, 1, 2, 3]), o
    assert rep["cause"] == "weights", rep["cause"]
    assert "the factory builds proj_t.weight NaN" in rep["hint"], rep["hint"]
    assert "checkpoint" in rep["hint"] and "intended -inf" not in rep["hint"], rep["hint"]
    assert "only row(s) 3 of 16 of proj_t.weight" in rep["hint"], rep["hint"]


def test_half_model_with_adam_names_the_optimizer_and_its_eps(tmp_path):
    """The speaker-adaptive model cast to float16 whole (``model.half()``) under Adam's
    default eps: 1e-8 is 0 in float16, so an entry whose gradient is 0 (a speaker embedding
    row no utterance of the batch used) divides 0 by 0 in the update, at step 0. The replay
    names the optimizer and the eps."""
    ev, bundle = fire(M.MultiTaskLoss(), tmp_path, make="make_speaker_model", half=True)
    assert (ev["step"], ev["phase"]) == (0, "optimizer"), ev
    rep = nanreplay_json(bundle, code=None)
    assert rep["cause"] == "optimizer", rep["cause"]
    assert "eps=1e-08 is 0 in float16" in rep["hint"], rep["hint"]


@pytest.mark.parametrize("momentum", [0.9, 0.0])
def test_opt_step_on_scaled_gradients_names_the_missing_scaler_step(tmp_path, momentum):
    """fp16 autocast with a GradScaler, but the loop calls ``opt.step()`` where it should call
    ``scaler.step(opt)``: SGD applies gradients 65536x too large, the weights jump from 11 to
    3478 in the first update and the attention's fp16 softmax overflows at step 1. The replay
    names the softmax in a2f.attn, every utterance, overflow and the weight jump; and now that
    the update took the scaled gradients (the momentum buffer, or without momentum the jump
    itself, is the scale times the norm the recorder read), not a learning rate too high."""
    model, loss = M.make_model(), M.MultiTaskLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)
    scaler = torch.amp.GradScaler("cpu")
    loader = torch.utils.data.DataLoader(M.utterances(16), batch_size=4, collate_fn=M.collate)
    with pytest.raises(NonFiniteError) as info, \
            FlightRecorder(model, opt, loss_fn=loss, out_dir=tmp_path, scaler=scaler,
                           factory="affective_computing_models:make_model") as rec:
        for b in loader:
            opt.zero_grad()
            with torch.autocast("cpu", torch.float16):
                out = model(b["audio"], b["face"], b["text"], b["a_pad"], b["f_pad"],
                            b["t_pad"])
                value = rec.loss_fn(out, b["va"], b["votes"])
            scaler.scale(value).backward()
            opt.step()  # the bug: scaler.step(opt); scaler.update()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"]) == (1, "forward", "a2f.attn"), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["samples"]) == (
        True, "a2f.attn", "aten._softmax", [0, 1, 2, 3]), o
    assert rep["cause"] == "overflow", rep["cause"]
    assert "the GradScaler's scale 65536: opt.step() was called on the scaled gradients" \
        in rep["hint"], rep["hint"]
    assert "lower the learning rate" not in rep["hint"], rep["hint"]
