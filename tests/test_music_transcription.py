"""End to end on piano transcription as Onsets and Frames writes it
(``music_transcription_models``): a log-mel front end inside the model (``torch.stft``, a mel
filterbank matmul, ``log(mel + eps)`` or ``10 log10(clamp(mel, amin))``), each clip's log-mel
standardised over its own valid frames of a batch padded to the longest clip, BiLSTMs over
frames, BCE on 88-key onset and frame rolls, the velocity loss masked by the onsets and
normalised by each clip's number of onsets, note decoding under ``no_grad``, Adam with a step
schedule and gradient clipping, a DataLoader whose collate pads. Each planted bug of the domain
fires under the recorder and is replayed with the CLI; the healthy versions raise no event and
train bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import music_transcription_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("music_transcription_models.py", text)


def loader(step: int, bad: dict, crop: int | None):
    data = M.ClipDataset(6, seed=step, crop=crop, **bad)
    return torch.utils.data.DataLoader(data, batch_size=6, collate_fn=M.collate)


def train(make: str, out_dir, bad: dict | None = None, steps: int = 3, record: bool = True,
          loss=M.transcription_loss, crop: int | None = None, amp: bool = False,
          accum: int = 1, init_scale: float = 2.0 ** 16):
    """Onsets and Frames' recipe: Adam, StepLR, clip_grad_norm_(3) (of the unscaled gradients
    under fp16 autocast and a GradScaler), the batch in ``accum`` micro-batches; ``bad``
    plants a clip in the last step's batch. Returns the model and the notes decoded."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=6e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.98)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, enabled=amp)
    torch.manual_seed(1)  # (dropout)
    rec = FlightRecorder(model, opt, loss_fn=loss, out_dir=out_dir, scaler=scaler if amp else None,
                         factory=f"music_transcription_models:{make}") if record else None
    notes = []
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else loss
        for step in range(steps):
            for batch in loader(step, bad if bad and step == steps - 1 else {}, crop):
                opt.zero_grad()
                for audio, lengths, onsets, frames, vel in zip(*(t.chunk(accum) for t in batch)):
                    with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
                        onset_logits, frame_logits, velocity, mask = model(audio, lengths)
                        total = loss_fn(onset_logits, frame_logits, velocity, mask, onsets,
                                        frames, vel)
                    scaler.scale(total / accum).backward()
                    notes.append(M.decode_notes(onset_logits, frame_logits))
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 3.0)
                scaler.step(opt)
                scale = scaler.get_scale()
                scaler.update()
                if scaler.get_scale() >= scale:  # (no schedule step where the update was skipped)
                    sched.step()
    return model, notes, scaler.get_scale()


def fire(make: str, tmp_path, bad: dict, loss=M.transcription_loss, crop: int | None = None,
         amp: bool = False, accum: int = 1):
    with pytest.raises(NonFiniteError) as info:
        train(make, tmp_path, bad, loss=loss, crop=crop, amp=amp, accum=accum)
    return info.value.event, info.value.bundle_path


def test_velocity_loss_of_a_silent_excerpt_names_the_division_by_its_onset_count(tmp_path):
    """A crop of digital silence (a piece's lead-in) has no onset, so the velocity loss of that
    clip, its masked squared error divided by its own number of onsets, is 0/0: a loss event,
    named at that division on the clip's row, with the advice to floor the count or filter the
    empty records; dropping the clip makes the step finite."""
    ev, bundle = fire("make_model", tmp_path, {"silent": 3})
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (2, "loss", "<loss>", "nan"), ev
    rep = nanreplay_json(bundle, "--try", "drop=3")
    o = rep["origin"]
    assert (rep["reproduced"], o["phase"], o["op"], o["made"], o["samples"]) == (
        True, "loss", "aten.div", "nan", [3]), o
    assert o["source"] == line_of(
        "velocity_loss = (onsets * (torch.sigmoid(velocity) - velocities) ** 2).sum((1, 2))"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]
    assert "clamp_min(1)" in rep["hint"] and "empty records" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_silent_excerpt_in_the_second_micro_batch_names_its_row_in_the_loader_batch(tmp_path):
    """Gradient accumulation over two micro-batches of 3 clips: the silent clip, 4th of the
    loader's batch, is row 1 of micro-batch 1; the replay says so and maps it back to row 4."""
    ev, bundle = fire("make_model", tmp_path, {"silent": 4}, accum=2)
    assert (ev["step"], ev["phase"], ev["micro_batch"]) == (2, "loss", 1), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], o["micro_batch"], o["samples"], o["batch_rows"]) == (
        "aten.div", 1, [1], [4]), o
    assert rep["cause"] == "invalid" and "clamp_min(1)" in rep["hint"], rep["hint"]


def test_log_mel_without_eps_of_zero_padding_names_the_log_and_the_padded_clips(tmp_path):
    """``log(mel + eps)`` with eps = 0 over a batch padded to its longest clip: a frame wholly
    in the zero padding has a mel energy of exactly 0, whose log is -inf at the very first
    step. The replay names the log in the front end, the clips padded by at least a window
    (those a hook on the front end counts), and the eps that is exactly 0."""
    audio, lengths, *_ = M.collate([M.ClipDataset(6, seed=0)[i] for i in range(6)])
    with torch.no_grad():
        padded = (~torch.isfinite(M.make_no_eps().frontend(audio))).any(2).any(1)
    rows = torch.nonzero(padded).flatten().tolist()
    assert rows == torch.nonzero(lengths <= lengths.max() - M.N_FFT).flatten().tolist() != []
    ev, bundle = fire("make_no_eps", tmp_path, {}, loss=M.guarded_loss)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (0, "forward", "frontend",
                                                                  "-inf"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "frontend", "aten.log", "-inf", rows), o
    assert o["source"] == line_of("return torch.log(mel + self.eps).transpose(1, 2)"), o
    assert rep["cause"] == "invalid" and "eps added to that input is exactly 0" in rep["hint"]


def test_amplitude_to_db_with_amin_zero_of_a_silent_crop_names_the_log10_and_the_clip(tmp_path):
    """``10 log10(clamp(mel, amin))`` with amin = 0 on fixed-length crops: only the crop of
    digital silence has a mel energy of 0, so log10 gives -inf on that clip alone at the last
    step; the replay names log10 in the front end, the clip, and the floor of 0 the clamp
    applied."""
    ev, bundle = fire("make_db_amin0", tmp_path, {"silent": 4}, loss=M.guarded_loss, crop=12)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (2, "forward", "frontend",
                                                                  "-inf"), ev
    rep = nanreplay_json(bundle, "--try", "drop=4")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "frontend", "aten.log10", "-inf", [4]), o
    assert o["source"] == line_of("10.0 * torch.log10(torch.clamp(mel, min=self.amin))"), o
    assert rep["cause"] == "invalid" and "floor that input is clamped to is exactly 0" in rep[
        "hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_clip_shorter_than_the_window_names_the_per_clip_mean_over_no_frame(tmp_path):
    """A trailing fragment shorter than n_fft has (len - n_fft) // hop + 1 = 0 valid frames, so
    the per-clip standardisation's mean over its valid frames is 0/0; BatchNorm then spreads
    the NaN to every clip of the batch. The replay names the division in the root's own code on
    that clip alone, and the advice to floor the count or filter the record."""
    ev, bundle = fire("make_unguarded", tmp_path, {"short": 2}, loss=M.guarded_loss)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (2, "forward", "", "nan"), ev
    rep = nanreplay_json(bundle, "--try", "drop=2")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("", "aten.div", "nan", [2]), o
    assert o["source"] == line_of("mean = (mel * m).sum(1, keepdim=True) / count"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]
    assert "clamp_min(1)" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_mel_filterbank_above_nyquist_names_the_buffer_the_factory_built(tmp_path):
    """fmax = 16 kHz on 8 kHz audio: the top filters cover no FFT bin, and dividing each filter
    by its area makes those rows 0/0 when the model is built. Step 0's front end is NaN on every
    clip; the replay blames the buffer ``frontend.fb`` as the factory built it, names its rows
    and the division of the factory's code that made them (the hint named no line for a
    buffer, only for a parameter)."""
    fb = M.make_fmax_above_nyquist().frontend.fb
    bad_rows = torch.nonzero(~torch.isfinite(fb).all(1)).flatten().tolist()
    ev, bundle = fire("make_fmax_above_nyquist", tmp_path, {}, loss=M.guarded_loss)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (0, "forward", "frontend",
                                                                  "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["module"]) == ("weights", "frontend"), o
    assert o["source"] == line_of("mel = torch.matmul(self.fb, spec.abs() ** 2)"), o
    assert rep["cause"] == "weights", rep
    made = f"aten.div of 0 made nan at {line_of('fb = fb / fb.sum(1, keepdim=True)')}"
    assert f"the factory builds buffer frontend.fb non-finite: {made}" in rep["hint"], rep["hint"]
    assert f"row(s) {bad_rows[0]}, {bad_rows[1]}" in rep["hint"], (bad_rows, rep["hint"])


def test_unrecorded_silent_excerpt_turns_the_weights_nan(tmp_path):
    """Without the recorder the velocity loss's 0/0 reaches every weight the velocity head
    trains (clipping a NaN norm keeps NaN): the event above is the bug, not a false alarm."""
    model, *_ = train("make_model", tmp_path, {"silent": 3}, steps=3, record=False)
    assert not torch.isfinite(model.velocity_stack[1].weight).all()


@pytest.mark.parametrize("make,crop,accum", [("make_model", None, 1), ("make_db", None, 1),
                                             ("make_model", 12, 2)])
def test_guarded_runs_raise_nothing_and_train_the_same(tmp_path, make, crop, accum):
    """The guarded recipe (eps 1e-6 or amin 1e-10, the frame count and the onset count floored
    at 1) on batches holding a silent clip and a clip shorter than the window, padded or
    cropped: no event, though the padding's log-mel is a large negative constant and one clip
    has no valid frame; weights and decoded notes are bit-identical with and without the
    recorder (the cropped run in two accumulated micro-batches)."""
    bad = {"silent": 1, "short": 4} if crop is None else {"silent": 1}
    recorded, notes, _ = train(make, tmp_path, bad, loss=M.guarded_loss, crop=crop, accum=accum)
    plain, plain_notes, _ = train(make, tmp_path, bad, loss=M.guarded_loss, crop=crop,
                               accum=accum, record=False)
    assert not list(tmp_path.glob("*.nan"))
    assert notes == plain_notes
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name
    assert all(torch.isfinite(p).all() for p in recorded.parameters())


def test_eps_of_1e_10_under_fp16_autocast_names_the_log_as_underflow(tmp_path):
    """librosa's amin 1e-10 used as the log's eps, trained under fp16 autocast: the filterbank
    matmul runs in half, the eps rounds to 0 there, and the silent crop's log is -inf. The
    replay says underflow (not invalid math), names the clip, and asks for an eps float16
    keeps or float32."""
    ev, bundle = fire("make_amp", tmp_path, {"silent": 3}, loss=M.guarded_loss, crop=12,
                      amp=True)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (2, "forward", "frontend",
                                                                  "-inf"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "frontend", "aten.log", "-inf", [3]), o
    assert rep["cause"] == "underflow", rep
    assert "the eps 1e-10 added to that input is 0 in float16" in rep["hint"], rep["hint"]
    assert "compute this in float32" in rep["hint"], rep["hint"]


def test_learned_filterbank_stepped_negative_names_the_parameter_not_a_clamp(tmp_path):
    """A trainable filterbank initialised at mel (mostly exact zeros) applied to the power
    spectrum, then a sqrt for magnitudes: Adam's first update steps the zeros to -lr, the
    weighted sum goes negative and sqrt is NaN at step 1 on every clip. The hint names
    ``frontend.fb`` and says to keep it non-negative by construction (the spectrum is data
    the graph does not keep: only the weights can take the sum below 0)."""
    ev, bundle = fire("make_learned_fb", tmp_path, {}, loss=M.guarded_loss, crop=12)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (1, "forward", "frontend",
                                                                  "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "frontend", "aten.sqrt", "nan", list(range(6))), o
    assert o["source"] == line_of("mel = mel.sqrt()"), o
    assert rep["cause"] == "invalid", rep
    assert "frontend.fb (min -0.0006) holds negative entries" in rep["hint"], rep["hint"]
    assert "non-negative by construction" in rep["hint"], rep["hint"]


def test_learned_front_end_on_a_silent_crop_names_the_std_s_sqrt_backward(tmp_path):
    """With a trainable filterbank the per-clip standardisation is on the graph: a crop of
    digital silence has a constant log-mel, a variance of exactly 0, and ``var.sqrt() + 1e-5``
    adds its eps after the sqrt, whose slope at 0 is +inf, so the gradient into the filterbank
    is NaN at the first step (a backward event; the forward is finite). The replay names
    SqrtBackward0 in the root's own code, that line (not the front end's magnitude sqrt, whose
    NaN comes later in backward order), the silent clip, and the advice to take
    sqrt(var + eps) of the deviations from their own mean (a std, not a distance)."""
    with pytest.raises(NonFiniteError) as info:
        train("make_learned_fb", tmp_path, {"silent": 3}, steps=1, loss=M.guarded_loss,
              crop=12)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["kind"]) == (0, "backward", "nan"), ev
    assert ev["detail"].endswith("first frontend.fb"), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"]) == (
        "backward", "", "SqrtBackward0", [3]), o
    assert o["source"] == line_of("return (mel - mean) / (var.sqrt() + 1e-5) * m"), o
    assert rep["cause"] == "invalid" and "sqrt(var + eps)" in rep["hint"], rep["hint"]
    assert "deviations from the values' own mean" in rep["hint"], rep["hint"]


def test_frame_transformer_with_padding_masked_raises_nothing_and_trains_the_same(tmp_path):
    """MT3-like: self-attention over frames with the padded frames as ``-inf`` in the key
    padding mask, one clip shorter than the window (every key masked) and a silent clip,
    under fp16 autocast with a GradScaler: no event, bit-identical weights and notes."""
    bad = {"silent": 1, "short": 4}
    recorded, notes, _ = train("make_transformer", tmp_path, bad, loss=M.guarded_loss, amp=True)
    plain, plain_notes, _ = train("make_transformer", tmp_path, bad, loss=M.guarded_loss,
                               amp=True, record=False)
    assert not list(tmp_path.glob("*.nan"))
    assert notes == plain_notes
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_top_db_floor_takes_back_padding_but_not_a_silent_clip(tmp_path):
    """AmplitudeToDB with amin = 0 and top_db = 80 over padded batches: log10 makes -inf in
    every frame wholly in the padding, which the floor 80 dB below each clip's peak takes back
    (no event at steps 0 and 1, whose batches are padded), but a silent clip's peak is -inf
    too. The replay names log10 on the silent clip alone, not the padded clip 5 whose -inf the
    floor took back, and the floor of 0 the clamp applied."""
    ev, bundle = fire("make_db_top", tmp_path, {"silent": 3}, loss=M.guarded_loss)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (2, "forward", "frontend",
                                                                  "-inf"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "frontend", "aten.log10", "-inf", [3]), o
    assert rep["cause"] == "invalid" and "clamped to is exactly 0" in rep["hint"], rep["hint"]


def test_top_db_floor_over_padding_raises_nothing_and_trains_the_same(tmp_path):
    """The same front end without a silent clip: the padded frames' -inf stays inside the
    front end (taken back by the top_db floor), no event, bit-identical weights."""
    recorded, notes, _ = train("make_db_top", tmp_path, {"short": 2}, loss=M.guarded_loss)
    plain, plain_notes, _ = train("make_db_top", tmp_path, {"short": 2}, loss=M.guarded_loss,
                               record=False)
    assert not list(tmp_path.glob("*.nan"))
    assert notes == plain_notes
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_per_clip_loss_over_no_valid_frame_names_the_loss_division_and_the_clip(tmp_path):
    """Each clip's BCE averaged over its own valid frames: the fragment shorter than n_fft has
    none, its mean is 0/0 in the loss (the model's standardisation is guarded). The replay names
    that division, the clip, and the advice to floor the count or filter the empty record."""
    ev, bundle = fire("make_model", tmp_path, {"short": 2}, loss=M.per_clip_loss)
    assert (ev["step"], ev["phase"], ev["module"]) == (2, "loss", "<loss>"), ev
    rep = nanreplay_json(bundle, "--try", "drop=2")
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"]) == ("aten.div", "nan", [2]), o
    assert o["source"] == line_of("per_clip = (bce * m).sum((1, 2)) / m.sum((1, 2))"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]
    assert "clamp_min(1)" in rep["hint"] and "empty records" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_pos_weight_of_a_key_no_clip_plays_names_the_division_and_the_bce_after_it(tmp_path):
    """Class-balanced frame BCE with ``pos_weight`` per key from the batch's counts: most of
    the 88 keys are silent in a batch of 6 clips, their weight is n/0 = +inf, and the BCE
    multiplies it by their 0 targets. A loss event at step 0 on no sample in particular; the
    replay names the +inf division (a pole, not 0/0) and the chain to the BCE's NaN."""
    ev, bundle = fire("make_model", tmp_path, {}, loss=M.balanced_loss)
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "loss", "<loss>"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"], o["all_samples"]) == (
        "aten.div", "+inf", [], False), o
    assert o["source"] == line_of("pos_weight = (m.sum((0, 1)) - pos) / pos"), o
    assert [c["op"] for c in o["chain"]] == ["aten.div",
                                             "aten.binary_cross_entropy_with_logits"], o
    assert rep["cause"] == "invalid" and "by 0 (x/0, a pole)" in rep["hint"], rep["hint"]


def test_fp16_steps_the_grad_scaler_skips_raise_nothing_and_train_the_same(tmp_path):
    """A loss scale of 2^40 overflows the fp16 backward: the GradScaler skips those steps
    (the scale halves each time, to 2^37 after three) and the recorder takes them for skips,
    not events; weights and notes are bit-identical with and without the recorder."""
    bad = {"silent": 1}
    recorded, notes, scale = train("make_transformer", tmp_path, bad, loss=M.guarded_loss,
                                   amp=True, init_scale=2.0 ** 40)
    plain, plain_notes, plain_scale = train("make_transformer", tmp_path, bad,
                                            loss=M.guarded_loss, amp=True,
                                            init_scale=2.0 ** 40, record=False)
    assert scale == plain_scale == 2.0 ** 37
    assert not list(tmp_path.glob("*.nan"))
    assert notes == plain_notes
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name
