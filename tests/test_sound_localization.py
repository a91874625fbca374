"""End to end on sound event localisation and detection (``sound_localization_models``): a
4-microphone clip, log-mel spectrograms and GCC-PHAT computed in ``forward`` (the
cross-spectrum divided by its magnitude), a CRNN with ACCDOA output, and a loss of MSE plus
the angular distance ``acos`` between unit predicted and target vectors weighted by activity.
Trained as DCASE baselines train: a DataLoader, Adam, gradient clipping (and float16
autocast). Each planted bug fires under the recorder and is replayed with the CLI; the healthy
run raises no event and trains bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import pytest
import sound_localization_models as M
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("sound_localization_models.py", text)


def train(make: str, out_dir, record: bool = True, amp: bool = False, loss_eps: float = 1e-8,
          crit=None, **plant):
    """Four steps of 8 clips (the planted clip 29 is row 5 of the last step)."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = crit if crit is not None else M.ACCDOALoss(eps=loss_eps)
    loader = torch.utils.data.DataLoader(M.ClipDataset(**plant), batch_size=8)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"sound_localization_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for audio, target in loader:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
                out = model(audio)
            loss = loss_fn(out.float(), target)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
    return model


def fire(make: str, tmp_path, **plant):
    with pytest.raises(NonFiniteError) as info:
        train(make, tmp_path, **plant)
    return info.value.event, info.value.bundle_path


EPS_ZERO = "the eps added to that input is exactly 0"


def test_silent_clip_under_gcc_phat_without_eps_names_the_division_and_the_silent_audio(
        tmp_path):
    """A clip of digital silence: its cross-spectra are 0 and PHAT's ``R / R.abs()`` is 0/0
    in that clip only. The hint names the silent audio (the model input), not the clip's
    all-zero ACCDOA target, which the forward op never read."""
    ev, bundle = fire("make_crnn_phat_no_eps", tmp_path, silent=29)
    assert (ev["step"], ev["phase"], ev["module"]) == (3, "forward", "features"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "features", "aten.div", "nan", [5]), o
    assert o["source"] == line_of("R = R / (R.abs() + self.eps)"), o
    h = rep["hint"]
    assert rep["cause"] == "invalid" and "0 by 0" in h and EPS_ZERO in h, h
    assert "batch is 0 everywhere in sample(s) 5 and not in any other sample" in h, h
    assert "loss_args" not in h, h


def test_nan_microphone_channel_is_an_input_event_naming_the_channel(tmp_path):
    """One microphone of clip 29 NaN from a bad recording: an input event on that clip, the
    channel named, and the bad capture given beside a per-channel pipeline step."""
    ev, bundle = fire("make_crnn", tmp_path, nan_mic=29)
    assert (ev["step"], ev["phase"], ev["samples"]) == (3, "input", [5]), ev
    rep = nanreplay_json(bundle)
    assert (rep["origin"]["phase"], rep["origin"]["samples"], rep["cause"]) == (
        "input", [5], "input"), rep
    h = rep["hint"]
    assert "sample 5 at index 2 of dim 1" in h, h
    assert "not a bad record" not in h and "failed during the take" in h, h


def test_log_mel_of_a_dead_microphone_without_floor_is_a_log_pole(tmp_path):
    """A disconnected capsule (channel 1 of clip 29 all 0) and ``log(mel)`` with its floor
    set to 0: -inf from aten.log in the features, on that clip."""
    ev, bundle = fire("make_crnn_log_no_eps", tmp_path, dead_mic=29)
    assert (ev["step"], ev["phase"], ev["module"]) == (3, "forward", "features"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "features", "aten.log", "-inf", [5]), o
    assert o["source"] == line_of("logmel = torch.log(mel + self.log_eps)"), o
    assert rep["cause"] == "invalid" and EPS_ZERO in rep["hint"], rep["hint"]


def test_float16_log_mel_with_a_1e_10_floor_underflows(tmp_path):
    """Under float16 autocast the mel projection (a matmul) rounds a quiet band to 0 and the
    floor 1e-10 is 0 in float16 too: log gives -inf, an underflow, named with its float32 fix."""
    ev, bundle = fire("make_crnn", tmp_path, amp=True)
    assert (ev["step"], ev["phase"], ev["module"]) == (1, "forward", "features"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "features", "aten.log", "-inf", [0]), o
    h = rep["hint"]
    assert rep["cause"] == "underflow" and "below float16's smallest normal" in h, h
    assert "the eps 1e-10 added to that input is 0 in float16" in h, h


def test_unnormalised_loud_recording_overflows_float16_in_the_mel_projection(tmp_path):
    """Clip 29 3000x louder: its power spectrum passes float16's max in autocast's cast before
    the mel matmul: +inf, an overflow on that clip, the out-of-scale sample named."""
    ev, bundle = fire("make_crnn_amp", tmp_path, amp=True, loud=29)
    assert (ev["step"], ev["phase"], ev["module"]) == (3, "forward", "features"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "features", "aten._to_copy", "+inf", [5]), o
    assert o["source"] == line_of("mel = torch.matmul(power, self.melW)"), o
    h = rep["hint"]
    assert rep["cause"] == "overflow" and "beyond float16's largest value" in h, h
    assert "sample(s) 5 of batch reach" in h and "out of scale" in h, h


def test_clip_with_no_event_normalised_in_the_angular_loss_is_0_over_0(tmp_path):
    """A clip with noise but no event: its ACCDOA target is the zero vector, and the angular
    term's ``target / target.norm()`` with eps 0 is 0/0 there, before the activity weight
    masks it: a loss event at the loss's division, clip 5."""
    ev, bundle = fire("make_crnn", tmp_path, no_event=29, loss_eps=0.0)
    assert (ev["step"], ev["phase"], ev["module"]) == (3, "loss", "<loss>"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "<loss>", "aten.div", "nan", [5]), o
    assert o["source"] == line_of("t = target / (target.norm(dim=-1, keepdim=True) + self"), o
    h = rep["hint"]
    assert rep["cause"] == "invalid" and "0 by 0" in h and EPS_ZERO in h, h
    assert "multiplied that NaN by a mask's 0" in h, h


def test_sed_masked_doa_norm_by_sqrt_is_a_backward_nan_on_the_clip_with_no_event(tmp_path):
    """The DOA output masked by the reference activity (DCASE 2019's baseline), its ACCDOA
    norm written ``sqrt((masked ** 2).sum(-1))``: 0 at the inactive frames of the clip with no
    event, finite forward, but sqrt's gradient there is inf and times 0 NaN: a backward event
    named at the loss's SqrtBackward0 on that clip, with vector_norm as the fix."""
    ev, bundle = fire("make_crnn", tmp_path, crit=M.MaskedDOALoss(), no_event=29)
    assert (ev["step"], ev["phase"]) == (3, "backward"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["made"], o["samples"]) == (
        "backward", "<loss>", "SqrtBackward0", "nan", [5]), o
    assert o["source"] == line_of("norm = torch.sqrt((masked ** 2).sum(-1))"), o
    h = rep["hint"]
    assert rep["cause"] == "invalid" and "torch.linalg.vector_norm(d, dim=-1)" in h, h


def test_healthy_seld_training_raises_nothing_and_is_bit_identical(tmp_path):
    a = train("make_crnn", tmp_path / "rec")
    b = train("make_crnn", tmp_path / "plain", record=False)
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), name
    assert not list((tmp_path / "rec").glob("*.nan"))
