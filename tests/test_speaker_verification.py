"""Speaker verification and diarization as SpeechBrain, WeSpeaker and EEND repositories train
it (``speaker_verification_models``): the recorder on the loop, then ``nanreplay``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import speaker_verification_models as M
import torch
from bundles import nanreplay_json, source_line
from torch.utils.data import DataLoader

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")
MODELS = "speaker_verification_models.py"


def train_ecapa(out_dir: Path | None, factory: str, crit, data, steps: int = 3,
                amp: torch.dtype | None = None, enrol: bool = False, workers: int = 0,
                give_scaler: bool = True):
    """AAM-softmax training of an ECAPA over a DataLoader of padded utterances (batches of 6,
    clipped gradients; under ``amp``, autocast and a GradScaler, given to the recorder unless
    ``give_scaler`` is False). ``out_dir`` None: no recorder. Returns the model, or the
    NonFiniteError the recorder raised."""
    model = getattr(M, factory)()
    loader = DataLoader(data, batch_size=6, collate_fn=M.collate_padded, num_workers=workers)
    if enrol:  # (the first batch holds one utterance of each speaker)
        M.enrol_head(model, *next(iter(loader)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", enabled=amp is not None)

    def loop():
        for _, (wav, lengths, labels) in zip(range(steps), loader):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
                loss = crit(model(wav, lengths), labels)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(opt)
            scaler.update()

    if out_dir is None:
        loop()
        return model
    try:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory=f"speaker_verification_models:{factory}",
                            scaler=scaler if give_scaler and amp is not None else None):
            loop()
    except NonFiniteError as e:
        return e
    raise AssertionError("no event")


def origin(rep: dict) -> tuple:
    o = rep["origin"]
    return rep["event"]["step"], o["phase"], o["module"], o["op"], o["samples"], rep["cause"]


def test_a_healthy_ecapa_raises_nothing_and_trains_bit_identically(tmp_path):
    """AAM-softmax over an ECAPA with attentive statistics pooling, and GE2E over an LSTM
    speaker encoder: no event, and the recorder changes no bit of the weights."""
    data = M.Utterances(18)
    plain = train_ecapa(None, "make_ecapa", M.AAMSoftmax(), data)
    torch.manual_seed(0)
    model = M.make_ecapa()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = M.AAMSoftmax()
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                        factory="speaker_verification_models:make_ecapa"):
        for wav, lengths, labels in DataLoader(data, batch_size=6, collate_fn=M.collate_padded):
            opt.zero_grad()
            crit(model(wav, lengths), labels).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
    for (name, a), b in zip(plain.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name
    assert not list(tmp_path.glob("*.nan"))


def test_a_digitally_silent_utterance_under_cmvn_without_eps_is_0_by_0_in_that_row(tmp_path):
    """A failed VAD cut leaves an utterance of digital zeros: its log-mel is log(eps), the same
    in every frame, and per-utterance CMVN divides its 0 deviation by a std of 0 (norm_eps
    set to 0). The report names the division in the fbank, the silent row, and the zero eps."""
    err = train_ecapa(tmp_path, "make_ecapa_no_norm_eps", M.AAMSoftmax(),
                      M.Utterances(18, silent=(8,)), workers=2)
    rep = nanreplay_json(err.bundle_path)
    assert origin(rep) == (1, "forward", "fbank", "aten.div", [2], "invalid"), \
        json.dumps(rep, indent=1)
    assert rep["origin"]["source"] == source_line(MODELS, "return (logmel - mean) / std * m")
    assert "eps added to that input is exactly 0" in rep["hint"], rep["hint"]


def test_a_one_frame_utterance_makes_the_pooled_std_nan_in_the_backward_only(tmp_path):
    """An utterance one frame long: attentive statistics pooling's weighted variance over its
    frames is exactly 0, sqrt of it is 0 in the forward and its derivative is infinite: the
    backward of the unclamped std is NaN in that row only (SpeechBrain clamps it at eps). The
    hint spoke of a distance between two coinciding points and offered
    torch.linalg.vector_norm; the root is of deviations from their own mean, a std: it now
    says so, and to clamp the variance."""
    err = train_ecapa(tmp_path, "make_ecapa_unclamped", M.AAMSoftmax(),
                      M.Utterances(18, short=(8,)))
    assert (err.event["step"], err.event["phase"]) == (1, "backward"), err.event
    rep = nanreplay_json(err.bundle_path)
    assert origin(rep) == (1, "backward", "pool", "SqrtBackward0", [2], "invalid"), \
        json.dumps(rep, indent=1)
    assert rep["origin"]["source"] == source_line(MODELS, "torch.cat([mu, torch.sqrt(var)]")
    hint = rep["hint"]
    assert "deviations from the values' own mean" in hint and "var.clamp(min=eps)" in hint, hint
    assert "two points coincide" not in hint, hint  # (vector_norm of the deviations is fine)


def test_a_pooled_std_as_moments_of_a_constant_utterance_is_a_rounding_of_equal_terms(
        tmp_path):
    """Pooling's std as sqrt(E[x²] − mu²): a silent utterance (CMVN with its eps maps it to 0)
    gives every channel one value over the frames, E[x²] and mu² agree to the last bit and
    their difference rounds below 0 — sqrt is NaN. The float64 re-run of the step crosses 0
    too, which the hint explained by float32 statistics accumulated over earlier steps in
    buffers; there are none: the spread is exactly 0, and float64 rounds it as well."""
    err = train_ecapa(tmp_path, "make_ecapa_moments", M.AAMSoftmax(),
                      M.Utterances(18, silent=(8,)))
    rep = nanreplay_json(err.bundle_path)
    assert origin(rep) == (1, "forward", "pool", "aten.sqrt", [2], "precision"), \
        json.dumps(rep, indent=1)
    hint = rep["hint"]
    assert "spread is exactly 0" in hint and "clamp_min(0)" in hint, hint
    assert "buffers" not in hint, hint


def test_an_unnormalised_recording_overflows_the_float16_mel_product(tmp_path):
    """Features computed inside autocast: the power spectrum goes to the mel matrix product in
    float16, and one recording 60x louder than the rest (a gain never normalised) overflows
    it. The report names the cast into the float16 product, that row, and the data's scale."""
    err = train_ecapa(tmp_path, "make_ecapa", M.AAMSoftmax(), M.Utterances(18, gain={8: 30.0}),
                      amp=torch.float16)
    rep = nanreplay_json(err.bundle_path)
    assert origin(rep) == (1, "forward", "fbank", "aten._to_copy", [2], "overflow"), \
        json.dumps(rep, indent=1)
    assert rep["origin"]["source"] == source_line(MODELS, "mel = torch.matmul(power")
    assert "out of scale" in rep["hint"] and "drop=2" in rep["hint"], rep["hint"]


def test_a_grad_scaler_not_given_whose_skips_merged_the_batches_is_said(tmp_path):
    """The same run with the GradScaler not given to the recorder: at scale 65536 the float16
    backward overflows, the scaler skips every update, no optimizer.step() runs, and the
    recorder took the loop's three batches for micro-batches 0-2 of step 0; the event at the
    loud row said step 0, micro-batch 1, and neither it nor the report said why. Both now say
    that the GradScaler was not given and how its skips made the micro-batches."""
    err = train_ecapa(tmp_path, "make_ecapa", M.AAMSoftmax(), M.Utterances(18, gain={8: 30.0}),
                      amp=torch.float16, give_scaler=False)
    ev = err.event
    assert (ev["step"], ev["phase"], ev["micro_batch"], ev["module"]) == \
        (0, "forward", 1, "fbank"), ev
    said = "so micro-batch 1 of step 0 is the loop's batch 1 (counted from 0)"
    assert "scaler=scaler" in str(err) and said in str(err), str(err)
    rep = nanreplay_json(err.bundle_path)
    assert origin(rep)[1:] == ("forward", "fbank", "aten._to_copy", [2], "overflow"), \
        json.dumps(rep, indent=1)
    assert any(said in p and "was not given" in p for p in rep["problems"]), rep["problems"]


def test_a_log_mel_eps_of_1e_10_is_0_in_float16_at_the_zero_padded_frames(tmp_path):
    """log(mel + 1e-10) under float16 autocast: the padded frames' mel energy is 0 and 1e-10
    is 0 in float16, so log gives -inf there (and the CMVN's sums NaN). The report names the
    log, the padded rows, underflow and the eps float16 loses."""
    err = train_ecapa(tmp_path, "make_ecapa_fp16_eps", M.AAMSoftmax(), M.Utterances(18),
                      amp=torch.float16)
    lengths = M.collate_padded([M.Utterances(18)[i] for i in range(6)])[1]
    n_frames = M.frame_mask(lengths, int(lengths.max())).sum(1)
    padded = [i for i, n in enumerate(lengths.tolist())
              if (int(lengths.max()) - M.N_FFT) // M.HOP + 1 > (n - 1) // M.HOP + 1]
    assert padded and len(padded) < 6, (padded, n_frames)
    rep = nanreplay_json(err.bundle_path)
    assert origin(rep) == (0, "forward", "fbank", "aten.log", padded, "underflow"), \
        json.dumps(rep, indent=1)
    assert "1e-10" in rep["hint"] and "float16" in rep["hint"], rep["hint"]


@pytest.mark.parametrize("mode", ["acos", "expansion"])
def test_aam_softmax_at_a_cosine_of_one_names_the_cosine_and_the_clamp(tmp_path, mode):
    """The classifier warm-started from the enrolment embeddings: the first batch's cosines at
    the target are 1 in exact arithmetic, and in float32 exactly 1.0 in some rows, 1.0000001
    or 0.99999994 in others (which, the reduction order of the threads' kernels decides).
    ArcFace's theta = acos(clamp(cos, -1, 1)) has an infinite derivative at 1: NaN in the
    backward. The cos/sin expansion's sqrt(1 - cos²) is NaN in the forward where the cosine
    rounded past 1, and in the backward where it is exactly 1. Its hints were the generic
    "catastrophic cancellation, as in a variance ... torch.var, logsigmoid" (forward) and "use
    a stable formula ... eps under the root" (backward); both now name 1 - x² of a cosine at
    or past ±1 and the clamp inside the domain."""
    err = train_ecapa(tmp_path, "make_ecapa", M.AAMSoftmax(mode=mode), M.Utterances(18),
                      enrol=True)
    model = M.make_ecapa()
    wav, lengths, labels = M.collate_padded([M.Utterances(18)[i] for i in range(6)])
    M.enrol_head(model, wav, lengths, labels)
    with torch.no_grad():  # (the step's cosines, as this process's kernels round them)
        cos = model(wav, lengths).gather(1, labels[:, None]).flatten()
    past, at = (cos > 1).nonzero().flatten().tolist(), (cos == 1).nonzero().flatten().tolist()
    assert past or at, cos.tolist()
    if mode == "acos":
        want = ("backward", "AcosBackward0", sorted(past + at), "torch.acos(cosine")
    elif past:
        want = ("loss", "aten.sqrt", past, "sine = torch.sqrt(1.0 - cosine")
    else:
        want = ("backward", "SqrtBackward0", at, "sine = torch.sqrt(1.0 - cosine")
    phase, op, rows, text = want
    rep = nanreplay_json(err.bundle_path)
    assert origin(rep) == (0, phase, "<loss>", op, rows, "precision"), json.dumps(rep, indent=1)
    assert rep["origin"]["source"] == source_line(MODELS, text)
    hint = rep["hint"]
    assert "cos.clamp(-1 + eps, 1 - eps)" in hint, hint
    if mode == "expansion":
        n = len(rows)
        said = (f"1 - x² of an x that rounding put past ±1 in {n} entr" if past else
                f"1 - x² of an x at exactly ±1 in {n} entr")
        assert said in hint and "AAM-softmax" in hint, hint
        assert "torch.var" not in hint and "cancellation" not in hint, hint


def test_ge2e_with_one_utterance_per_speaker_divides_the_exclusive_centroid_by_zero(tmp_path):
    """GE2E's centroid without the utterance itself, (sum - e) / (M - 1): a batch sampled with
    one utterance per speaker makes it 0/0 for every row. The report names the loss's
    division by the number 0, every sample, and the n - 1 of one element."""
    model = M.make_speaker_encoder()
    crit = M.GE2ELoss()
    opt = torch.optim.SGD([*model.parameters(), *crit.parameters()], lr=1e-2)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="speaker_verification_models:make_speaker_encoder"):
            for step in range(3):
                n_utt = 1 if step == 1 else 3
                wav, lengths = M.ge2e_batch(step, n_utt=n_utt)
                opt.zero_grad()
                crit(model(wav, lengths), n_utt).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 3.0)
                opt.step()
    rep = nanreplay_json(info.value.bundle_path)
    assert origin(rep) == (1, "loss", "<loss>", "aten.div", [0, 1, 2, 3], "invalid"), \
        json.dumps(rep, indent=1)
    assert rep["origin"]["source"] == source_line(MODELS, "excl = (total - e) / (n_utt - 1)")
    assert "n - 1 of one element" in rep["hint"], rep["hint"]


def test_a_class_balanced_pit_bce_over_a_chunk_where_a_speaker_is_silent_says_a_count(tmp_path):
    """EEND's permutation invariant BCE with each speaker's active frames weighted by its
    silent ones over its active ones, per recording (pos_weight = neg / pos): a chunk in which
    the second speaker of recording 1 says nothing has pos = 0 there, and the weight is x/0.
    The report named the division and the recording, but called the record degenerate, to
    drop or repair where the data is made; a speaker silent in a chunk is an ordinary record
    of diarization. The hint now says the divisor is a count per sample and class, and to
    clamp it or take the weights over the training set."""
    model = M.make_eend()
    crit = M.PITBCE(balance=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="speaker_verification_models:make_eend"):
            for step in range(3):
                wav, lengths, labels = M.diarization_batch(
                    step, absent=((1, 1),) if step == 2 else ())
                opt.zero_grad()
                crit(model(wav, lengths), labels).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                opt.step()
    rep = nanreplay_json(info.value.bundle_path)
    assert origin(rep) == (2, "loss", "<loss>", "aten.div", [1], "invalid"), \
        json.dumps(rep, indent=1)
    assert rep["origin"]["source"] == source_line(MODELS, "pos_weight = ((1 - y) * m)")
    hint = rep["hint"]
    assert "count per sample and class" in hint and "sample(s) [1]" in hint, hint
    assert "count.clamp(min=1)" in hint, hint


def test_healthy_ge2e_and_eend_raise_nothing(tmp_path):
    """GE2E with three utterances per speaker and EEND's plain PIT BCE: no event."""
    enc, crit = M.make_speaker_encoder(), M.GE2ELoss()
    opt = torch.optim.SGD([*enc.parameters(), *crit.parameters()], lr=1e-2)
    with FlightRecorder(enc, opt, loss_fn=crit, out_dir=tmp_path,
                        factory="speaker_verification_models:make_speaker_encoder"):
        for step in range(2):
            wav, lengths = M.ge2e_batch(step)
            opt.zero_grad()
            crit(enc(wav, lengths), 3).backward()
            opt.step()
    eend, pit = M.make_eend(), M.PITBCE(balance=True)
    opt = torch.optim.Adam(eend.parameters(), lr=1e-3)
    with FlightRecorder(eend, opt, loss_fn=pit, out_dir=tmp_path,
                        factory="speaker_verification_models:make_eend"):
        for step in range(2):
            wav, lengths, labels = M.diarization_batch(step)
            opt.zero_grad()
            pit(eend(wav, lengths), labels).backward()
            opt.step()
    assert not list(tmp_path.glob("*.nan"))


def test_a_resumed_checkpoint_with_a_nan_speaker_row_is_the_weights(tmp_path):
    """Training resumed from a checkpoint that an unchecked run saved after an update made one
    speaker's classifier row NaN: every sample's cosine to that speaker is NaN at step 0. The
    report names the weights (the parameter, as loaded before the recorder attached)."""
    model = M.make_ecapa()
    with torch.no_grad():
        model.classifier[3] = float("nan")
    crit = M.AAMSoftmax()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = DataLoader(M.Utterances(18), batch_size=6, collate_fn=M.collate_padded)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="speaker_verification_models:make_ecapa"):
            for wav, lengths, labels in loader:
                opt.zero_grad()
                crit(model(wav, lengths), labels).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["params"]) == (0, "weights", ["classifier"]), ev
    rep = nanreplay_json(info.value.bundle_path)
    assert (rep["cause"], rep["origin"]["phase"]) == ("weights", "weights"), \
        json.dumps(rep, indent=1)
    assert "classifier" in rep["hint"] and "checkpoint" in rep["hint"], rep["hint"]


def test_a_linear_warmup_of_zero_steps_gives_sgd_a_nan_learning_rate(tmp_path):
    """lr = base * min(1, step / warmup) with warmup = int(ratio * total) of a ratio of 0, in
    numpy scalars: 0/0 is NaN (a warning, not an error) and SGD's first update makes every
    parameter NaN. The report names the optimizer and the NaN learning rate."""
    import numpy as np

    model = M.make_ecapa()
    crit = M.AAMSoftmax()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    warmup = np.int64(0.0 * 3)  # warmup_ratio = 0
    loader = DataLoader(M.Utterances(18), batch_size=6, collate_fn=M.collate_padded)
    with pytest.raises(NonFiniteError) as info, np.errstate(divide="ignore", invalid="ignore"):
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="speaker_verification_models:make_ecapa"):
            for step, (wav, lengths, labels) in enumerate(loader):
                for g in opt.param_groups:
                    g["lr"] = 0.1 * np.minimum(1.0, step / np.float64(warmup))
                opt.zero_grad()
                crit(model(wav, lengths), labels).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"]) == (0, "optimizer"), ev
    rep = nanreplay_json(info.value.bundle_path, code=None)
    assert rep["cause"] == "optimizer", json.dumps(rep, indent=1)
    assert "lr was nan" in rep["hint"], rep["hint"]
