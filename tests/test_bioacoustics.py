"""End to end on bird and whale call detectors (``bioacoustics_models``): a log-mel or PCEN
frontend (an IIR smoother run frame by frame, parameters learned through exp), per-recording
standardisation, SpecAugment from torch's RNG, a PANNs-style CNN with frame probabilities,
energy-based VAD gating the frames, linear-softmax or masked attention pooling to clip
scores, mixup of clips and soft labels, focal loss or BCE with per-class positive weights.
Each planted failure of the domain fires under the recorder and is replayed with the CLI;
the healthy detectors raise no event and train bit-identically with and without it."""

from __future__ import annotations

import contextlib

import bioacoustics_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("bioacoustics_models.py", text)


def train(make: str, out_dir, silent: int | None = None, steps: int = 4, record: bool = True,
          mixup: bool = False, loss: str = "focal", amp: bool = False, pcm: int | None = None):
    """AdamW with a OneCycle schedule and gradient clipping, as PANNs and BirdNET train;
    mixup (PANNs' pairs of clips, Beta(0.4) weights) when asked; the clip ``silent`` is
    digital silence in the last step's batch, the clip ``pcm`` raw 16-bit PCM; ``amp``:
    the forward under float16 autocast. Returns the model."""
    model = getattr(M, make)()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=steps)
    g = torch.Generator().manual_seed(0)
    crit = M.focal_loss
    if loss == "weighted_bce":  # weights from the training set's labels, one class never seen
        labels = M.clip_batch(torch.Generator().manual_seed(1), n=64)[1]
        labels[:, 2] = 0.0
        crit = M.WeightedBCE(labels)
    torch.manual_seed(1)  # (SpecAugment's masks)
    beta = torch.distributions.Beta(0.4, 0.4)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"bioacoustics_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for step in range(steps):
            last = step == steps - 1
            wav, labels = M.clip_batch(g, silent=silent if last else None,
                                       pcm=pcm if last else None)
            if mixup:
                lam = beta.sample()
                wav = lam * wav + (1 - lam) * wav.flip(0)
                labels = lam * labels + (1 - lam) * labels.flip(0)
            with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
                clip, _ = model(wav)
            loss = loss_fn(clip.float(), labels)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
    return model


def fire(make: str, tmp_path, silent: int | None = 5, **kw):
    with pytest.raises(NonFiniteError) as info:
        train(make, tmp_path, silent, **kw)
    return info.value.event, info.value.bundle_path


def test_log_mel_without_offset_names_the_log_of_the_zero_padding_at_step_0(tmp_path):
    """``torch.log(mel)`` with no offset: every clip is zero-padded to the batch's length, so
    the frames past each recording's end are digital silence, mel energy exactly 0 and
    ``log`` -inf in every sample from the first step. The event and the replay name the
    frontend's first call, the log on its line, every sample, and say to add an eps."""
    ev, bundle = fire("make_logmel_no_offset", tmp_path, silent=None)
    assert (ev["step"], ev["phase"], ev["module"], ev["call"], ev["kind"]) == (
        0, "forward", "frontend", 0, "-inf"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "frontend", "aten.log", "-inf", list(range(8))), o
    assert o["source"] == line_of("return torch.log(mel)  # the bug"), o
    assert rep["cause"] == "invalid" and "log has a pole at 0" in rep["hint"], rep["hint"]
    assert "add an eps" in rep["hint"], rep["hint"]


def test_per_recording_standardisation_of_a_silent_clip_names_the_division_and_the_clip(
        tmp_path):
    """A dead channel's clip of digital silence: its log-mel is the constant ``log(1e-6)``,
    so the per-recording ``(x - mean) / std`` divides by a std of 0 on that clip alone (the
    BatchNorm after it then spreads NaN to every sample, as the event sees it). The replay
    names the division on its line, clip 5 only, and the all-zero record as the cause to
    filter; dropping it makes the step finite."""
    ev, bundle = fire("make_standardised", tmp_path, silent=5)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (3, "forward", "", "nan"), ev
    rep = nanreplay_json(bundle, "--try", "drop=5")
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"]) == ("", "aten.div", [5]), o
    assert o["source"] == line_of("x = (x - x.mean((1, 2), keepdim=True)) / x.std("), o
    assert rep["cause"] == "invalid" and "0 everywhere in sample(s) 5" in rep["hint"], rep
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_pcen_with_eps_0_names_the_agc_division_and_the_zero_eps(tmp_path):
    """PCEN configured with ``eps=0``: on a silent clip the IIR smoother ``M`` is 0 in every
    frame, ``(eps + M) ** alpha`` is 0 (alpha learned through exp) and ``E / that`` is 0/0.
    The replay names the division in the frontend, clip 5, and says the eps added before
    the power is exactly 0: set it to a positive value. The silent clip's weak labels (no
    species set) are not offered as an empty mask that explains the 0/0: its waveform is 0
    everywhere, and a forward op never took the labels."""
    ev, bundle = fire("make_pcen_eps0", tmp_path, silent=5)
    assert (ev["step"], ev["phase"], ev["module"], ev["call"], ev["kind"]) == (
        3, "forward", "frontend", 0, "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "frontend", "aten.div", "nan", [5]), o
    assert o["source"] == line_of("agc = e / (self.eps + smooth) ** alpha"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]
    assert "the eps added to that input is exactly 0" in rep["hint"], rep["hint"]
    assert "loss_args" not in rep["hint"], rep["hint"]


def test_pcen_delta_learned_as_is_from_a_negative_init_names_the_power_and_the_parameter(
        tmp_path):
    """PCEN's delta learned as it is (not through exp), initialised at -0.7 from a config that
    meant log(delta): ``(E / M ** alpha + delta) ** r`` takes a fractional power of a negative
    number wherever the normalised energy is below 0.7, in every clip at step 0. The replay
    names the power on its line, every sample, and the parameter frontend.delta, to keep
    non-negative by construction (learn its log) rather than clamp the base."""
    ev, bundle = fire("make_pcen_raw_delta", tmp_path, silent=None)
    assert (ev["step"], ev["phase"], ev["module"], ev["call"], ev["kind"]) == (
        0, "forward", "frontend", 0, "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "frontend", "aten.pow", "nan", list(range(8))), o
    assert o["source"] == line_of("return (agc + delta) ** r - delta ** r"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "an offset the model learns" in rep["hint"], rep["hint"]
    assert "frontend.delta (min -0.7) holds negative entries" in rep["hint"], rep["hint"]
    assert "exp(w)" in rep["hint"], rep["hint"]


def test_linear_softmax_pooling_over_frames_all_gated_names_the_pooling_division(tmp_path):
    """Linear-softmax pooling ``sum(y^2) / sum(y)`` over the frames the energy VAD keeps: a
    silent clip keeps none, so both sums are 0 and the clip score is 0/0. The replay names
    the pooling's division on its line, clip 5, 0/0 with the eps advice, and does not call
    the clip's all-negative weak labels an empty mask (its waveform, not its labels, is
    blank; the labels never reach the forward)."""
    ev, bundle = fire("make_linear_softmax", tmp_path, silent=5)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (3, "forward", "", [5]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("", "aten.div", "nan", [5]), o
    assert o["source"] == line_of("clip = (y ** 2).sum(1) / y.sum(1)"), o
    assert rep["cause"] == "invalid" and "add an eps to the denominator" in rep["hint"], rep
    assert "empty records" not in rep["hint"], rep["hint"]


def test_linear_softmax_pooling_of_an_underflowed_prior_init_names_underflow(tmp_path):
    """The frame head's bias from RetinaNet's prior init with a prior of 1e-60: every frame
    probability is sigmoid(-138), 0 in float32, so ``sum(y^2) / sum(y)`` is 0/0 in every clip
    at step 0. The replay names the pooling's division, every sample, and underflow (the sum
    is 2e-119 in float64), with the log-space advice, not an empty-record hint."""
    ev, bundle = fire("make_linear_softmax_prior", tmp_path, silent=None)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (0, "forward", "", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "", "aten.div", "nan", list(range(8))), o
    assert o["source"] == line_of("clip = (y ** 2).sum(1) / y.sum(1)"), o
    assert rep["cause"] == "underflow" and "log space" in rep["hint"], rep["hint"]
    assert "empty records" not in rep["hint"], rep["hint"]


def test_attention_pooling_over_frames_all_gated_names_the_masked_softmax(tmp_path):
    """Attention pooling whose scores are -inf at the frames the VAD gates: a silent clip has
    every frame gated, the softmax row is all -inf and NaN. The replay names the softmax,
    clip 5, the fully masked row, and the all-zero record to filter."""
    ev, bundle = fire("make_pcen", tmp_path, silent=5)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (3, "forward", "", [5]), ev
    rep = nanreplay_json(bundle, "--try", "drop=5")
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"]) == ("", "aten._softmax", [5]), o
    assert o["source"] == line_of("clip = (torch.softmax(scores, 1) * frame)"), o
    assert rep["cause"] == "invalid" and "fully masked row" in rep["hint"], rep["hint"]
    assert "0 everywhere in sample(s) 5" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_pos_weight_of_a_species_never_seen_names_the_loss_buffer(tmp_path):
    """Per-class positive weights ``neg / pos`` from the training labels, one species with no
    positive clip: its weight is inf, and BCE's ``(pw - 1) * y`` is inf * 0 for every
    negative clip. A loss event at step 0; the replay names the BCE op, the loss's
    pos_weight at index 2, made before the step, and says to floor the count."""
    ev, bundle = fire("make_logmel", tmp_path, silent=None, loss="weighted_bce")
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "loss", "<loss>"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["op"]) == ("loss", "aten.binary_cross_entropy_with_logits"), o
    assert o["source"] == line_of("return F.binary_cross_entropy_with_logits("), o
    assert rep["cause"] == "weights", rep["cause"]
    assert "'pos_weight' holding inf at index 2" in rep["hint"], rep["hint"]
    assert "clamp_min(1)" in rep["hint"], rep["hint"]


def test_raw_pcm_clip_under_float16_autocast_names_the_cast_of_its_power(tmp_path):
    """One file read as raw 16-bit PCM (not scaled to [-1, 1]) among float clips, the forward
    under float16 autocast: its power spectrum reaches ~4e11 in float32, and autocast's cast
    for the mel filterbank's matmul overflows float16. The replay names that cast in the
    frontend, clip 2 alone, overflow, and the clip's out-of-scale data as the fix (a gain
    never normalised), not a wider type; dropping it makes the step finite."""
    ev, bundle = fire("make_logmel", tmp_path, silent=None, amp=True, pcm=2)
    assert (ev["step"], ev["phase"], ev["module"], ev["call"]) == (3, "forward", "frontend", 0)
    rep = nanreplay_json(bundle, "--try", "drop=2")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "frontend", "aten._to_copy", "+inf", [2]), o
    assert o["source"] == line_of("mel = torch.matmul(self.fbank, power)"), o
    assert rep["cause"] == "overflow" and "beyond float16's largest value" in rep["hint"], rep
    assert "sample(s) 2 of batch" in rep["hint"] and "out of scale" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


@pytest.mark.parametrize("make,mixup,amp", [("make_logmel", True, True),
                                            ("make_pcen", True, False),
                                            ("make_linear_softmax", False, False)])
def test_healthy_detectors_raise_nothing_and_train_the_same(tmp_path, make, mixup, amp):
    """Zero-padded clips (their padded frames' attention scores -inf inside the model, the
    VAD's log10 of a floored energy), SpecAugment from torch's RNG, mixup, float16 autocast,
    PCEN's frame loop: no event, and bit-identical weights with and without the recorder."""
    recorded = train(make, tmp_path, mixup=mixup, steps=3, amp=amp)
    plain = train(make, tmp_path, mixup=mixup, steps=3, record=False, amp=amp)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def train_accumulated(make: str, out_dir, silent: int, steps: int = 3):
    """A DataLoader of 4-clip batches, two micro-batches accumulated per AdamW step (the loss
    halved), as BirdNET-Analyzer's fine-tuning fits a large batch on a small GPU; the clip
    ``silent`` (of the 8 the last step draws) is digital silence."""
    model = getattr(M, make)()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    clips = [M.clip_batch(g, silent=silent if s == steps - 1 else None) for s in range(steps)]
    data = torch.utils.data.TensorDataset(torch.cat([w for w, _ in clips]),
                                          torch.cat([y for _, y in clips]))
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=False)
    torch.manual_seed(1)
    with FlightRecorder(model, opt, loss_fn=M.focal_loss, out_dir=out_dir,
                        factory=f"bioacoustics_models:{make}") as rec:
        for i, (wav, labels) in enumerate(loader):
            clip, _ = model(wav)
            (rec.loss_fn(clip, labels) / 2).backward()
            if i % 2 == 1:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                opt.step()
                opt.zero_grad()


def test_silent_clip_in_the_second_accumulated_micro_batch_is_named_there(tmp_path):
    """The silent clip is row 1 of the last step's second micro-batch: under PCEN with eps 0
    the event and the replay name micro-batch 1, the AGC division, that row, and the eps of
    0."""
    with pytest.raises(NonFiniteError) as info:
        train_accumulated("make_pcen_eps0", tmp_path, silent=5)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["micro_batch"], ev["module"]) == (
        2, "forward", 1, "frontend"), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["micro_batch"], o["module"], o["op"], o["samples"]) == (
        1, "frontend", "aten.div", [1]), o
    assert o["source"] == line_of("agc = e / (self.eps + smooth) ** alpha"), o
    assert "the eps added to that input is exactly 0" in rep["hint"], rep["hint"]


def test_unrecorded_silent_clip_under_pcen_eps_0_goes_nan_silently(tmp_path):
    """Without the recorder the same run finishes with NaN weights (clip_grad_norm_ of a NaN
    norm scales every gradient to NaN): the events above are the bug, not false alarms."""
    model = train("make_pcen_eps0", tmp_path, silent=5, record=False)
    assert not all(torch.isfinite(p).all() for p in model.parameters())
