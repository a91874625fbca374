"""Self-supervised speech and neural audio codecs as fairseq's wav2vec 2.0 and EnCodec /
SoundStream / parallel_wavegan repositories train them (``speech_ssl_models``): the recorder on
the loop, then ``nanreplay --json`` on its bundle."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import speech_ssl_models as S
import torch
from bundles import nanreplay_json, source_line
from torch.utils.data import DataLoader

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

MODELS = "speech_ssl_models.py"
W2V = "speech_ssl_models:make_wav2vec2"


def train_w2v(out_dir: Path | None, factory: str = W2V, steps: int = 4, smoothing: float = 0.0,
              allow_inf=("",)):
    """fairseq's pre-training loop: AdamW with a warm-up, the Gumbel temperature annealed per
    update, gradients clipped; padded variable-length batches from a collate_fn."""
    torch.manual_seed(0)
    model = getattr(S, factory.split(":")[1])()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    crit = S.Wav2Veccriterion(label_smoothing=smoothing)
    loader = DataLoader(S.Utterances(4 * steps), batch_size=4, collate_fn=S.collate)
    rec = contextlib.nullcontext() if out_dir is None else FlightRecorder(
        model, opt, loss_fn=crit, out_dir=out_dir, factory=factory, allow_inf=list(allow_inf))
    with rec:
        for step, (wav, pad) in enumerate(loader):
            model.set_num_updates(step)
            opt.zero_grad()
            crit(*model(wav, pad)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            sched.step()
    return model


def duplicate_rows(step: int = 0) -> list[int]:
    """The utterances of ``step`` with a distractor identical to its target (fairseq's
    ``neg_is_pos``), seen by a hook on an unrecorded run of the same loop."""
    seen = {}
    orig = S.Wav2Vec2.compute_preds

    def spy(self, x, y, negatives):
        seen.setdefault(len(seen), (y == negatives).all(-1).any(-1).any(0))
        return orig(self, x, y, negatives)

    S.Wav2Vec2.compute_preds = spy
    try:
        train_w2v(None, steps=step + 1)
    finally:
        S.Wav2Vec2.compute_preds = orig
    return seen[step].nonzero().flatten().tolist()


def test_healthy_wav2vec2_on_padded_batches_raises_nothing_and_trains_bit_identically(tmp_path):
    """Padded batches, -inf logits for duplicated distractors (allowed at the root, as the
    report below advises): no event, and the same weights as without the recorder."""
    assert duplicate_rows(0), "the case: a distractor equal to its target at step 0"
    recorded = train_w2v(tmp_path)
    plain = train_w2v(None)
    assert not list(tmp_path.iterdir())
    for (name, a), b in zip(recorded.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), name


def test_duplicated_distractor_names_the_index_put_of_the_root_not_the_encoders_mask(tmp_path):
    """fairseq's ``logits[1:][neg_is_pos] = float("-inf")`` reaches the root output, which by
    default is an event. The report named ``aten.masked_fill_`` in ``encoder`` (the
    Transformer's key padding mask, consumed inside it) with the padded utterances as samples:
    ``x[m] = -inf`` is an ``index_put_`` of a 0-d tensor ``lift_fresh`` made of the literal,
    which was not read as a literal fill. It now names that line, in the root's own code, the
    utterances holding a duplicate, and the allow_inf pattern to add."""
    rows = duplicate_rows(0)
    with pytest.raises(NonFiniteError) as info:
        train_w2v(tmp_path, allow_inf=())
    err = info.value
    assert (err.event["step"], err.event["module"], err.event["kind"]) == (0, "", "-inf")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("", "aten.index_put_", rows, "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == source_line(MODELS, 'logits[1:][neg_is_pos] = float("-inf")')
    assert "allow_inf=['']" in " ".join(rep["problems"]), rep["problems"]


def test_label_smoothing_over_a_masked_distractor_names_the_utterances_through_the_flatten(
        tmp_path):
    """``label_smoothing`` spreads weight over every candidate, the -inf duplicates too: the
    loss is -inf. The logits are ``(1 + K, B, M)``, flattened as ``transpose(0, 2).reshape(-1,
    1 + K)``, row ``m * B + b``: the report named no samples; the batch's dimension is now
    followed through that view (merged with the dims before it)."""
    rows = duplicate_rows(0)
    with pytest.raises(NonFiniteError) as info:
        train_w2v(tmp_path, smoothing=0.1)
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (0, "loss"), err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["samples"], rep["cause"]) == ("loss", rows, "invalid"), \
        json.dumps(rep, indent=1)
    assert o["source"] == source_line(MODELS, "loss = F.cross_entropy(logits.float()")
    assert "label smoothing" in rep["hint"], rep["hint"]


def test_code_perplexity_without_eps_is_log_of_an_unused_code_not_a_mask_times_zero(tmp_path):
    """The logged code perplexity ``exp(-sum p log p)`` of the hard codes' counts without its
    ``+ 1e-7``: a code no frame used is ``0 * log 0``. Recorded with ``allow_inf=['']`` (the
    -inf logits), the report called the log's -inf intentional (the root's pattern counted for
    every submodule) and advised about masked entries, with the rows of those -inf logits as
    samples. '' now covers the root's own code only: the log of 0 is blamed, with the eps
    of exactly 0, and no utterance is named for a count over the whole batch."""
    with pytest.raises(NonFiniteError) as info:
        train_w2v(tmp_path, factory="speech_ssl_models:make_wav2vec2_no_log_eps")
    err = info.value
    assert (err.event["step"], err.event["module"], err.event["kind"]) == (0, "quantizer", "nan")
    assert err.event["samples"] == [], err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == \
        ("quantizer", "aten.log", "-inf", [], "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == source_line(MODELS, "code_ppl = torch.exp(")
    assert "exactly 0" in rep["hint"] and "mask" not in rep["hint"], rep["hint"]


# ---------------------------------------------------------------------------------------------
# codec + multi-period discriminator


def train_codec(out_dir: Path | None, steps: int = 3, fixed: int | None = 800, **loss):
    """EnCodec-style: the discriminator's LSGAN step first (its own optimizer, unrecorded),
    then the generator's multi-scale STFT loss + commitment + adversarial term, clipped."""
    silent, quiet = loss.pop("silent", ()), loss.pop("quiet", ())
    torch.manual_seed(0)
    codec, mpd = S.make_codec(), S.make_mpd()
    g_opt = torch.optim.AdamW(codec.parameters(), 3e-4, betas=(0.8, 0.99))
    d_opt = torch.optim.AdamW(mpd.parameters(), 3e-4, betas=(0.8, 0.99))
    crit = S.MultiScaleSTFTLoss(**loss)
    loader = DataLoader(S.Utterances(4 * steps, silent=silent, quiet=quiet, fixed=fixed),
                        batch_size=4, collate_fn=S.collate)
    rec = contextlib.nullcontext() if out_dir is None else FlightRecorder(
        codec, g_opt, loss_fn=crit, out_dir=out_dir, factory="speech_ssl_models:make_codec")
    with rec:
        for wav, _ in loader:
            y_hat, commit = codec(wav)
            d_opt.zero_grad()
            S.d_lsgan(mpd(wav), mpd(y_hat.detach())).backward()
            d_opt.step()
            g_opt.zero_grad()
            loss = crit(y_hat, wav) + 0.25 * commit + 0.1 * S.g_lsgan(mpd(y_hat))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(codec.parameters(), 1.0)
            g_opt.step()
    return codec


@pytest.mark.parametrize("power", [False, True])
def test_healthy_codec_gan_on_padded_batches_raises_nothing_and_trains_bit_identically(
        tmp_path, power):
    """Zero-padded clips (magnitude 0 in the padding, clamped at 1e-7), EMA codebooks written
    in the forward, a discriminator stepped by its own optimizer: no event, and the codec's
    weights and codebooks as without the recorder."""
    recorded = train_codec(tmp_path, fixed=None, power=power)
    plain = train_codec(None, fixed=None, power=power)
    assert not list(tmp_path.iterdir())
    for (name, a), b in zip(recorded.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), name


def test_silent_clip_reconstruction_log_magnitude_is_exact_zero_not_precision(tmp_path,
                                                                               monkeypatch):
    """The clamp forgotten, ``log(stft(y_hat).abs())``: a silent clip's reconstruction is
    periodic (the same code in every frame through the stride-4 decoder), so bins between its
    harmonics are 0 in exact arithmetic. Where float32's FFT rounds them to exactly 0 (MKL on
    the AMD EPYC) the estimate's log is the first at the pole; float64 leaves them at 6e-17, a
    residue of the spectrum's largest bin; the report said ``precision`` ("exact arithmetic
    does not cross" the pole). It now says ``invalid``, float64's value a residue, and clamp.
    Where float32 leaves them a residue too (MKL on an Intel Xeon), the first pole is the
    silent target's own log on the same line: ``invalid``, the target computed from the
    batch's data alone, floor both sides. Which one ran into the pole is read from the
    estimate's magnitude itself, so the test checks the hint that fits this CPU."""
    estimate_zero = {}
    magnitude = S.MultiScaleSTFTLoss.magnitude

    def watched(self, x, n_fft):
        out = magnitude(self, x, n_fft)
        if x.requires_grad:  # (the estimate; the last step's values are kept)
            estimate_zero[n_fft] = bool((out[2] == 0).any())
        return out

    monkeypatch.setattr(S.MultiScaleSTFTLoss, "magnitude", watched)
    with pytest.raises(NonFiniteError) as info:
        train_codec(tmp_path, floor=None, silent=(6,))
    first_scale_zero = estimate_zero[64]
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (1, "loss"), err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["op"], o["samples"], rep["cause"]) == ("aten.log", [2], "invalid"), \
        json.dumps(rep, indent=1)
    assert o["source"] == source_line(MODELS, "log_term = F.l1_loss(torch.log(s_hat)")
    if first_scale_zero:
        assert "residue" in rep["hint"] and "clamp" in rep["hint"], rep["hint"]
    else:
        assert "computed from the batch's data alone" in rep["hint"], rep["hint"]
        assert "residue" not in rep["hint"] and "clamp_min(eps)" in rep["hint"], rep["hint"]


@pytest.mark.parametrize("clip", ["silent", "quiet"])
def test_power_spectrum_log_of_a_silent_clip_is_invalid_of_a_quiet_one_underflow(tmp_path,
                                                                                 clip):
    """parallel_wavegan's ``sqrt(re² + im²)`` without its clamp, the target's log first:
    digital silence is a magnitude of exactly 0 (``invalid``, floor both sides); a near-silent
    clip (1e-24) has re² + im² ~ 1e-46, below float32's smallest subnormal: squares of non-zero
    values, positive in exact arithmetic, rounded to 0 (``underflow``). The report called the
    latter ``precision`` (a cancellation): the square is now followed as positive where its
    base is non-zero."""
    with pytest.raises(NonFiniteError) as info:
        train_codec(tmp_path, floor=None, power=True, **{clip: (6,)})
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (1, "loss"), err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    want = "invalid" if clip == "silent" else "underflow"
    assert (o["op"], o["samples"], rep["cause"]) == ("aten.log", [2], want), \
        json.dumps(rep, indent=1)
    assert o["source"] == source_line(MODELS, "log_term = F.l1_loss(torch.log(s), ")
    hint = rep["hint"]
    if clip == "silent":
        assert "clamp_min(eps)" in hint and "1e-7" in hint, hint
    else:
        assert "square" in hint and "clamp_min(eps)" in hint and "log space" not in hint, hint
