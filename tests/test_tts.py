"""Speech synthesis trained as FastSpeech2 and Tacotron2 repositories train it
(``tts_models``): variable-length utterances padded by a ``collate_fn``, masked losses
normalised by the valid frames, teacher forcing; the recorder on the loop, then ``nanreplay``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import tts_models as T
from bundles import nanreplay_json
from torch.utils.data import DataLoader

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def train_fastspeech2(out_dir: Path, crit: T.FastSpeech2Loss, steps: int = 3, **data):
    model = T.make_fastspeech2()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = DataLoader(T.dataset(n=4 * steps, **data), batch_size=4, collate_fn=T.collate)
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                        factory="tts_models:make_fastspeech2"):
        for phones, phone_lens, dur, pitch, energy, mel in loader:
            opt.zero_grad()
            loss = crit(model(phones, phone_lens, dur, pitch), mel, dur, pitch, energy)
            (loss[0] if crit.parts else loss).backward()
            opt.step()


def test_healthy_fastspeech2_and_tacotron2_raise_no_event(tmp_path):
    """Padded phones and frames, -inf attention masks, the length regulator's
    repeat_interleave, a fully masked decoder row (an utterance the aligner gave 0 frames):
    none of it is an event while every loss and gradient is finite."""
    train_fastspeech2(tmp_path / "fs2", T.FastSpeech2Loss(), failed=(6,))
    train_tacotron2(tmp_path / "taco", steps=3)
    assert not list(tmp_path.rglob("*.nan"))


@pytest.mark.parametrize("parts", [False, True])
def test_frame_rmse_at_padding_is_named_in_the_loss_backward(tmp_path, parts):
    """A per-frame RMSE of mel frames: at padded frames the masked output and the padded
    target are both 0, sqrt's derivative there is inf, times the frame mask's 0 is NaN; the
    model's own masked_fill drops it, so every parameter's gradient stays finite. The report
    named no op ("loss terms computed outside loss_fn", which the loss is not): now the loss's
    SqrtBackward0, invalid as float64 makes it too (it said precision: float64 was judged by
    the parameters' gradients only), on the rows that have padded frames. ``parts``: the loss
    returns ``(total, {"mel": ..., "duration": ...})`` for logging, as most recipes do; the
    re-run differentiated nothing of such a tuple, so the op stayed unnamed."""
    with pytest.raises(NonFiniteError) as info:
        train_fastspeech2(tmp_path, T.FastSpeech2Loss(frame_rmse=True, parts=parts))
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (0, "backward")
    dur = T.collate(T.dataset(n=12)[:4])[2]
    padded = [i for i, n in enumerate(dur.sum(1).tolist()) if n < dur.sum(1).max()]
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], rep["cause"], o["samples"]) == \
        ("backward", "<loss>", "SqrtBackward0", "invalid", padded), json.dumps(rep, indent=1)
    assert o["source"].startswith("tts_models.py:"), o["source"]
    assert "outside" not in rep["hint"] and "torch.where" in rep["hint"], rep["hint"]


def train_tacotron2(out_dir: Path, steps: int = 4, empty_step: int | None = None,
                    row: int = 2):
    model = T.make_tacotron2()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = T.Tacotron2Loss()
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                        factory="tts_models:make_tacotron2"):
        for step in range(steps):
            text, text_lens, mel, mel_lens = T.tacotron_batch(
                step, empty=row if step == empty_step else None)
            opt.zero_grad()
            crit(model(text, text_lens, mel), mel, mel_lens, text_lens).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()


def test_an_emptied_transcript_is_named_at_the_attention_softmax_of_its_row(tmp_path):
    """A cleaner emptied one transcript: its text mask is all True, the location-sensitive
    attention's masked softmax of that row is NaN in the first decoder step; named there (one
    call of many in the teacher-forced decoder loop), that row only, and dropping it clears
    the step."""
    with pytest.raises(NonFiniteError) as info:
        train_tacotron2(tmp_path, empty_step=2)
    err = info.value
    assert (err.event["step"], err.event["module"], err.event["samples"]) == (2, "attention", [2])
    rep = nanreplay_json(err.bundle_path, "--try", "auto")
    o = rep["origin"]
    assert (o["phase"], o["module"], o["call"], o["op"], o["samples"], rep["cause"]) == \
        ("forward", "attention", 0, "aten._softmax", [2], "invalid"), json.dumps(rep, indent=1)
    [what_if] = rep["what_if"]
    assert what_if["try"] == "drop=2" and what_if["finite"] is True, what_if
