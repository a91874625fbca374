"""Speech separation and enhancement as Conv-TasNet, asteroid and DCCRN-style repositories
train it (``speech_separation_models``): the recorder on the loop, then ``nanreplay``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import speech_separation_models as S
import torch
from bundles import nanreplay_json
from torch.utils.data import DataLoader

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def train_enhancer(out_dir: Path, crit, steps: int = 3, short: tuple = (5,)) -> NonFiniteError:
    model = S.make_crm_enhancer()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = DataLoader(S.VariableLength(4 * steps, short=short), batch_size=4,
                        collate_fn=S.collate_padded)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="speech_separation_models:make_crm_enhancer"):
            for noisy, clean, _ in loader:
                opt.zero_grad()
                crit(model(noisy), clean).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                opt.step()
    return info.value


@pytest.mark.parametrize("db", [False, True])
def test_a_log_magnitude_loss_at_zero_padding_says_floor_both_sides_not_drop_the_clip(tmp_path,
                                                                                      db):
    """A multi-resolution STFT loss whose magnitude is sqrt(re² + im²) without parallel_wavegan's
    clamp: a clip shorter than the batch is zero-padded, its padded frames' magnitude is 0 and
    the log-magnitude L1 takes log(0) = -inf of the target (and of the estimate, NaN after the
    subtraction). The hint called the clip a degenerate record to drop or repair, and said an
    eps would train toward a made-up target; the loss compares the log of the target with the
    log of the estimate, so it now says to floor both sides alike or mask the padding.
    ``db``: the log term as a log-power in dB, ``10 * log10(|S|²)``, each side scaled before
    the subtraction."""
    err = train_enhancer(tmp_path, S.MultiResolutionSTFTLoss(clamp=False, db=db))
    lens = S.collate_padded([S.VariableLength(12, short=(5,))[i] for i in range(4, 8)])[2]
    padded = [i for i, n in enumerate(lens.tolist()) if n < lens.max()]
    assert err.event["step"] == 1 and err.event["phase"] == "loss", err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("loss", "<loss>", "aten.log10" if db else "aten.log", padded, "invalid"), \
        json.dumps(rep, indent=1)
    assert o["source"].startswith("speech_separation_models.py:"), o["source"]
    hint = rep["hint"]
    assert "clamp_min(eps)" in hint and "zero padding" in hint and "mask" in hint, hint
    assert "degenerate" not in hint and "made-up" not in hint, hint


def test_a_reference_peak_normalised_to_nan_is_the_data_not_a_mask_over_missing_values(tmp_path):
    """Mixtures made on the fly in DataLoader workers at a random SNR, the clean reference
    peak-normalised after mixing: a silent clip's reference is 0/0, NaN in the loss target
    only. The hint said a mask multiplied missing values by 0 (``NaN * 0 is NaN``, fill them
    with nan_to_num) at the STFT's line: the product was stft's framing by the Hann window,
    whose first value is 0, and which drops nothing. A product is taken for a mask only
    where it is 0 at every NaN; the hint now sends the user to the data pipeline."""
    silent = 6  # dataset index: step 1, row 2
    model = S.make_crm_enhancer()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = S.MultiResolutionSTFTLoss()
    loader = DataLoader(S.NoisyMixtures(12, silent_speech=(silent,), peak_norm=True),
                        batch_size=4, num_workers=2)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="speech_separation_models:make_crm_enhancer"):
            for noisy, clean in loader:
                opt.zero_grad()
                crit(model(noisy), clean).backward()
                opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"], err.event["tensor"]) == \
        (silent // 4, "input", "loss_args[1]"), err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["tensor"], o["op"], o["samples"], rep["cause"]) == \
        ("input", "loss_args[1]", None, [silent % 4], "input"), json.dumps(rep, indent=1)
    assert "mask" not in rep["hint"] and "data pipeline" in rep["hint"], rep["hint"]


def test_pcm_read_without_scaling_overflows_the_float16_encoder_in_every_row_it_does(tmp_path):
    """16-bit PCM read as int16 and cast with ``.float()`` without ``/ 32768``, trained under
    float16 autocast: the cast of the mixture to float16 overflows in the loudest clip, and the
    encoder's convolution overflows in other clips whose samples fit in float16. The report
    named the cast's row only, as though dropping that clip cleared the step; the convolution
    makes each output row of its own input row, so the rows it made non-finite of finite values
    are the origin's samples too (as the recorder's event said)."""
    model = S.make_conv_tasnet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = S.PITSISNR()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="speech_separation_models:make_conv_tasnet"):
            for step in range(2):
                mix, src = (t * 32768.0 for t in S.mixtures(step))  # PCM, not in [-1, 1]
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = crit(model(mix), src)
                loss.backward()
                opt.step()
    err = info.value
    mix = S.mixtures(0)[0] * 32768.0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        w = S.make_conv_tasnet().encoder(mix.unsqueeze(1))
    over = (~torch.isfinite(w)).flatten(1).any(1).nonzero().flatten().tolist()
    cast = (mix.abs() > torch.finfo(torch.float16).max).any(1).nonzero().flatten().tolist()
    assert set(cast) < set(over), (cast, over)  # (the case: rows the cast did not overflow)
    assert (err.event["step"], err.event["module"]) == (0, "encoder"), err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("forward", "encoder", "aten._to_copy", over, "overflow"), json.dumps(rep, indent=1)
    assert "float32" in rep["hint"], rep["hint"]


def test_an_update_skipped_on_a_non_finite_grad_norm_is_not_blamed_on_the_model(tmp_path):
    """ESPnet's and SpeechBrain's loops skip the update when clip_grad_norm_'s total norm is not
    finite (``optimizer.zero_grad()``, no ``step()``). SI-SNR as 20 log10 of a ratio of norms,
    each sqrt(sum of squares), gives a silent reference source a sqrt(0): its backward is NaN.
    The loop skips that update; the next batch is a second micro-batch of the same step, and the
    step closes with finite gradients. The event and the report said every parameter's
    gradient stayed finite because the model's backward drops those entries (a ReLU, a mask),
    which it does not: they now say the loop dropped micro-batch 0's gradients. ``--try
    drop=1`` was inconclusive ("the unchanged re-run is finite too"): the re-run did not look
    at the gradients it dropped as the loop did; it does now."""
    k, row = 2, 1
    model = S.make_conv_tasnet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = S.PITSISNR(amplitude=True)
    skipped = []
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="speech_separation_models:make_conv_tasnet"):
            for step in range(5):
                mix, src = S.mixtures(step, silent=((row, 0),) if step == k else ())
                opt.zero_grad()
                crit(model(mix), src).backward()
                if not torch.isfinite(torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)):
                    skipped.append(step)
                    opt.zero_grad()  # "grad norm is nan: skipping updating the model"
                    continue
                opt.step()
    err = info.value
    assert skipped == [k], skipped
    ev = err.event
    assert (ev["step"], ev["phase"], ev["micro_batch"], ev["samples"]) == (k, "backward", 0, [row])
    assert "the loop dropped micro-batch 0's before micro-batch 1" in ev["detail"], ev["detail"]
    rep = nanreplay_json(err.bundle_path, "--try", "auto")
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["micro_batch"], o["samples"], rep["cause"]) == \
        ("backward", "<loss>", "SqrtBackward0", 0, [row], "invalid"), json.dumps(rep, indent=1)
    [what_if] = rep["what_if"]
    assert (what_if["try"], what_if["finite"], what_if["inconclusive"]) == \
        (f"drop={row}", True, False), what_if
    assert not any("ReLU" in p for p in rep["problems"]), rep["problems"]
    assert any("the loop had dropped micro-batch 0's gradients" in p for p in rep["problems"]), \
        rep["problems"]


def test_end_step_before_a_skipped_update_checks_the_gradients_it_drops(tmp_path):
    """The same skip in an STFT-domain enhancer whose forward takes the estimate's magnitude as
    sqrt(re² + im²) without an eps: a silent clip (speech silent, the noise scaled to its RMS
    of 0) is all zeros, and sqrt's backward there is NaN in the model's own backward, with
    the gradient entering the output finite. The recorder saw nothing: the loop dropped the
    gradients, and ``rec.end_step()`` before the skip, which the guide offers for loops that
    update by hand, closed the step without reading them. It reads them now, as ``step()``'s
    pre-hook does: the event is that step's, and the report names the node and the clip."""
    silent = 6  # dataset index: step 1, row 2
    model = S.make_crm_enhancer_polar()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = S.MultiResolutionSTFTLoss()
    loader = DataLoader(S.NoisyMixtures(16, silent_speech=(silent,)), batch_size=4)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="speech_separation_models:make_crm_enhancer_polar") as rec:
            for noisy, clean in loader:
                opt.zero_grad()
                crit(model(noisy), clean).backward()
                if not torch.isfinite(torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)):
                    rec.end_step()  # checked as step() would, before the gradients go
                    opt.zero_grad()
                    continue
                opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (silent // 4, "backward"), err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("backward", "", "SqrtBackward0", [silent % 4], "invalid"), json.dumps(rep, indent=1)
