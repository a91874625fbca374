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
          loss=M.transcription_loss, crop: int | None = None):
    """Onsets and Frames' recipe: Adam, StepLR, clip_grad_norm_(3); ``bad`` plants a clip in
    the last step's batch. Returns the model and the notes decoded at each step."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=6e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.98)
    torch.manual_seed(1)  # (dropout)
    rec = FlightRecorder(model, opt, loss_fn=loss, out_dir=out_dir,
                         factory=f"music_transcription_models:{make}") if record else None
    notes = []
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else loss
        for step in range(steps):
            for audio, lengths, onsets, frames, vel in loader(
                    step, bad if bad and step == steps - 1 else {}, crop):
                onset_logits, frame_logits, velocity, mask = model(audio, lengths)
                total = loss_fn(onset_logits, frame_logits, velocity, mask, onsets, frames, vel)
                opt.zero_grad()
                total.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 3.0)
                opt.step()
                sched.step()
                notes.append(M.decode_notes(onset_logits, frame_logits))
    return model, notes


def fire(make: str, tmp_path, bad: dict, loss=M.transcription_loss, crop: int | None = None):
    with pytest.raises(NonFiniteError) as info:
        train(make, tmp_path, bad, loss=loss, crop=crop)
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
    and sends the user to the code that computes it."""
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
    assert "the factory builds buffer frontend.fb non-finite" in rep["hint"], rep["hint"]
    assert f"row(s) {bad_rows[0]}, {bad_rows[1]}" in rep["hint"], (bad_rows, rep["hint"])


def test_unrecorded_silent_excerpt_turns_the_weights_nan(tmp_path):
    """Without the recorder the velocity loss's 0/0 reaches every weight the velocity head
    trains (clipping a NaN norm keeps NaN): the event above is the bug, not a false alarm."""
    model, _ = train("make_model", tmp_path, {"silent": 3}, steps=3, record=False)
    assert not torch.isfinite(model.velocity_stack[1].weight).all()


@pytest.mark.parametrize("make,crop", [("make_model", None), ("make_db", None),
                                       ("make_model", 12)])
def test_guarded_runs_raise_nothing_and_train_the_same(tmp_path, make, crop):
    """The guarded recipe (eps 1e-6 or amin 1e-10, the frame count and the onset count floored
    at 1) on batches holding a silent clip and a clip shorter than the window, padded or
    cropped: no event, though the padding's log-mel is a large negative constant and one clip
    has no valid frame; weights and decoded notes are bit-identical with and without the
    recorder."""
    bad = {"silent": 1, "short": 4} if crop is None else {"silent": 1}
    recorded, notes = train(make, tmp_path, bad, loss=M.guarded_loss, crop=crop)
    plain, plain_notes = train(make, tmp_path, bad, loss=M.guarded_loss, crop=crop,
                               record=False)
    assert not list(tmp_path.glob("*.nan"))
    assert notes == plain_notes
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name
    assert all(torch.isfinite(p).all() for p in recorded.parameters())
