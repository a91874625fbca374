"""End to end on neural audio synthesis (``audio_synthesis_models``): DDSP's harmonic-plus-noise
autoencoder under its multi-scale spectral loss (Adam, exponential decay, clipping), HiFi-GAN's
generator and discriminators with two optimizers (least-squares, feature-matching and mel-L1
losses, ExponentialLR as the reference recipe), and a WaveNet's 256-way softmax over mu-law
classes. Each planted bug of the domain fires under the recorder and is replayed with the CLI;
the healthy versions raise no event and train bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib
import functools
import itertools

import audio_synthesis_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("audio_synthesis_models.py", text)


def recording(model, opt, loss_fn, out_dir, make: str, record: bool):
    if not record:
        return contextlib.nullcontext(None)
    return FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=out_dir,
                          factory=f"audio_synthesis_models:{make}")


def train_ddsp(out_dir, make: str = "make_ddsp", *, steps: int = 4, record: bool = True,
               plain_log: bool = False, **bad):
    """ddsp_pytorch's train.py: Adam, an exponential learning-rate decay, the multi-scale
    spectral loss, clip_grad_norm_; ``bad`` is planted in the last step's batch."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, 0.99)
    crit = M.SpectralLoss(plain_log=plain_log)
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(1)  # the filtered noise's torch.rand
    with recording(model, opt, crit, out_dir, make, record):
        for step in range(steps):
            f0, loud, audio = M.ddsp_batch(g, **(bad if step == steps - 1 else {}))
            inputs = (f0, audio) if "autoencoder" in make else (f0, loud)
            loss = crit(model(*inputs), audio)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
    return model


def train_hifigan(out_dir, make: str = "make_generator", *, record: bool = True, short=(),
                  sqrt_eps: float = 1e-9, floor: bool = True, zero_disc: bool = False):
    """HiFi-GAN's train.py over a DataLoader (3 batches of 4): AdamW(0.8, 0.99) for each
    network, the discriminator's update on the detached fake, then the generator's on 45 x mel
    L1 + feature matching + adversarial (one loss module around the discriminator); the recorder is given the generator and its
    optimizer. ``short`` clips are padded with silence by the collate, ``floor`` its log-mel's
    clamp, ``sqrt_eps`` the loss's magnitude eps."""
    gen, disc = getattr(M, make)(), M.Discriminator(zero_disc)
    crit = M.GeneratorLoss(disc, sqrt_eps)
    opt_g = torch.optim.AdamW(gen.parameters(), 2e-4, betas=(0.8, 0.99))
    opt_d = torch.optim.AdamW(disc.parameters(), 2e-4, betas=(0.8, 0.99))
    scheds = [torch.optim.lr_scheduler.ExponentialLR(o, 0.999) for o in (opt_g, opt_d)]
    loader = torch.utils.data.DataLoader(M.Notes(short=short), batch_size=4,
                                         collate_fn=functools.partial(M.collate, floor=floor))
    with recording(gen, opt_g, crit, out_dir, make, record):
        for mel, y, lengths in loader:
            y = y.unsqueeze(1)
            y_g_hat = gen(mel, lengths)
            opt_d.zero_grad()
            real, fake, _, _ = disc(y, y_g_hat.detach())
            M.discriminator_loss(real, fake).backward()
            opt_d.step()

            opt_g.zero_grad()
            crit(y_g_hat, y).backward()
            opt_g.step()
            for s in scheds:
                s.step()
    return gen, disc


def train_wavenet(out_dir, *, steps: int = 4, record: bool = True, accumulate: int = 2,
                  bf16: bool = False):
    """Teacher-forced WaveNet: cross-entropy over 256 mu-law classes, Adam with a step decay,
    two micro-batches accumulated per update; ``bf16``: the forward under bfloat16 autocast,
    the cross-entropy of its logits in float32."""
    model = M.make_wavenet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    crit = torch.nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(0)
    with recording(model, opt, crit, out_dir, "make_wavenet", record):
        for _, k in itertools.product(range(steps), range(accumulate)):
            x, y = M.wavenet_batch(g)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logits = model(x)
            (crit(logits.float(), y) / accumulate).backward()
            if k == accumulate - 1:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
                sched.step()
    return model


def same_weights(a: torch.nn.Module, b: torch.nn.Module):
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("make,bad", [("make_ddsp", {"glitch": 3, "padded": 5}),
                                      ("make_ddsp_softmax", {"padded": 5}),
                                      ("make_autoencoder", {"padded": 5})])
def test_healthy_ddsp_raises_nothing_and_trains_the_same(tmp_path, make, bad):
    """exp_sigmoid's floor, the Nyquist mask's + 1e-4 and the spectral loss's eps: a record
    whose pitch tracker jumped above Nyquist and a clip padded with digital silence raise no
    event; the softmax over the harmonics below Nyquist takes the -inf its mask writes over the
    high notes' upper harmonics in every step (a mask that stays inside). The weights are
    bit-identical with and without the recorder (the noise's torch.rand draws the same)."""
    recorded = train_ddsp(tmp_path, make, **bad)
    plain = train_ddsp(tmp_path, make, record=False, **bad)
    assert not list(tmp_path.glob("*.nan"))
    same_weights(recorded, plain)


def test_healthy_hifigan_raises_nothing_and_trains_the_same(tmp_path):
    """weight_norm and spectral_norm parametrizations, two optimizers, the discriminator run
    on the detached fake then again for the generator: no event, the same weights."""
    recorded = train_hifigan(tmp_path, short=[9])
    plain = train_hifigan(tmp_path, short=[9], record=False)
    assert not list(tmp_path.glob("*.nan"))
    for a, b in zip(recorded, plain):
        same_weights(a, b)


@pytest.mark.parametrize("bf16", [False, True])
def test_healthy_wavenet_raises_nothing_and_trains_the_same(tmp_path, bf16):
    """Two accumulated micro-batches an update, in float32 and under bfloat16 autocast: no
    event, the same weights with and without the recorder."""
    recorded = train_wavenet(tmp_path, bf16=bf16)
    plain = train_wavenet(tmp_path, bf16=bf16, record=False)
    assert not list(tmp_path.glob("*.nan"))
    same_weights(recorded, plain)


def fire(train, *args, **kwargs):
    with pytest.raises(NonFiniteError) as info:
        train(*args, **kwargs)
    return info.value.event, info.value.bundle_path


def test_nyquist_mask_without_floor_names_the_harmonic_normalisation_and_the_record(tmp_path):
    """The Nyquist mask ported as a plain 0/1 mask (no ``+ 1e-4``): record 3's pitch tracker
    jumped to 4.2 kHz, above the 4 kHz Nyquist with every harmonic, so that frame's harmonic
    distribution is 0/0. The replay names the division on its line, record 3 alone, 0/0 and the
    eps on the denominator."""
    ev, bundle = fire(train_ddsp, tmp_path, "make_ddsp_no_nyquist_floor", glitch=3)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"], ev["kind"]) == (
        3, "forward", "", [3], "nan"), ev
    rep = nanreplay_json(bundle, "--try", "drop=3")
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "", "aten.div", "nan", [3]), o
    assert o["source"] == line_of("amplitudes = amplitudes / amplitudes.sum(-1, keepdim=True)")
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]
    assert "eps to the denominator" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_softmax_of_harmonics_all_above_nyquist_names_the_fully_masked_row(tmp_path):
    """The harmonic distribution as a softmax whose harmonics above Nyquist are masked with
    -inf: record 3's 4.2 kHz glitch masks every harmonic of its frames, a fully masked row.
    The replay names the softmax on its line, the mask's -inf as intended, record 3, and says
    to keep one entry per row or mask with a finite number; dropping it makes the step
    finite."""
    ev, bundle = fire(train_ddsp, tmp_path, "make_ddsp_softmax", glitch=3)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"], ev["kind"]) == (
        3, "forward", "", [3], "nan"), ev
    rep = nanreplay_json(bundle, "--try", "drop=3")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("", "aten._softmax", "nan", [3])
    assert o["source"] == line_of("amplitudes = torch.softmax(logits, -1) * total_amp"), o
    assert rep["cause"] == "invalid" and "every entry is -inf" in rep["hint"], rep["hint"]
    assert "large finite negative number" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_loudness_of_digital_silence_names_the_log10_and_the_padded_clip(tmp_path):
    """The autoencoder's loudness, computed from the audio in forward, as 10 log10 of each
    frame's power without its eps: clip 5's zero padding is -inf dB. The recorder names the
    loudness module and clip 5; the replay the log10 on its line, the pole at 0 and its
    eps; dropping the clip makes the step finite."""
    ev, bundle = fire(train_ddsp, tmp_path, "make_autoencoder_no_eps", padded=5)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"], ev["kind"]) == (
        3, "forward", "loudness", [5], "-inf"), ev
    rep = nanreplay_json(bundle, "--try", "drop=5")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "loudness", "aten.log10", "-inf", [5]), o
    assert o["source"] == line_of("db = 10 * torch.log10(power)"), o
    assert rep["cause"] == "invalid" and "of 0 (log has a pole at 0" in rep["hint"]
    assert "clamp_min(eps)" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_log_magnitude_of_padded_silence_names_the_target_and_the_floor(tmp_path):
    """The spectral loss's log |S| without its eps: clip 5 is short and padded with digital
    silence, whose STFT frames are exactly 0, so log |S_target| is -inf and the L1 +inf. A loss
    event; the replay names the log on its line, the padded clip, and says to floor both sides
    alike or mask the padding."""
    ev, bundle = fire(train_ddsp, tmp_path, plain_log=True, padded=5)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (3, "loss", "<loss>", "+inf")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["made"], o["samples"]) == (
        "loss", "<loss>", "aten.log", "-inf", [5]), o
    assert o["source"] == line_of("loss = loss + (torch.log(s) - torch.log(t)).abs().mean()")
    assert rep["cause"] == "invalid", rep["cause"]
    assert "silence in a spectrum" in rep["hint"] and "clamp_min(eps)" in rep["hint"]
    assert "zero padding" in rep["hint"], rep["hint"]


def test_weight_norm_of_a_zero_initialised_conv_names_the_parametrization(tmp_path):
    """The generator's last conv zero-initialised ("start from silence") under weight_norm:
    g * v / |v| is 0/0 in the first forward. The replay names weight_norm's op in the
    parametrization, the conv's call on its line, and says to zero the magnitude instead."""
    ev, bundle = fire(train_hifigan, tmp_path, "make_generator_zero_post")
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (
        0, "forward", "conv_post.parametrizations.weight.0", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"]) == (
        "conv_post.parametrizations.weight.0", "aten._weight_norm_interface", "nan"), o
    assert o["source"] == line_of("y = torch.tanh(self.conv_post(F.leaky_relu(x)))"), o
    assert rep["cause"] == "invalid" and "original1, which is all 0" in rep["hint"]
    assert "zero its magnitude original0" in rep["hint"], rep["hint"]


def test_magnitude_without_eps_at_a_padded_frame_names_sqrt_backward_in_the_loss(tmp_path):
    """The mel loss's magnitude written as sqrt(re² + im²) without HiFi-GAN's + 1e-9: the
    generator's output is silenced past clip 9's end (row 1 of the last batch), so those STFT
    frames are exactly 0, the log-mel's clamp passes no gradient there and sqrt's backward
    makes 0 * 1/0 = NaN. The loss module holds the discriminator, whose convs are
    weight_norm/spectral_norm parametrized (classes made at run time, rebuilt by the
    discriminator's own construction): the replay re-runs it and names SqrtBackward0 in the
    loss on its line, the short clip, and the complex modulus's own abs."""
    ev, bundle = fire(train_hifigan, tmp_path, short=[9], sqrt_eps=0.0)
    assert (ev["step"], ev["phase"], ev["kind"]) == (2, "backward", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"]) == (
        "backward", "<loss>", "SqrtBackward0", [1]), o
    assert o["source"] == line_of("spec = torch.sqrt(spec.real.pow(2) + spec.imag.pow(2))")
    assert rep["cause"] == "invalid" and "torch.complex(re, im).abs()" in rep["hint"]
    assert "sqrt(x + eps)" in rep["hint"], rep["hint"]


def test_log_mel_of_zero_padding_in_the_collate_is_an_input_event_pointing_at_the_log(
        tmp_path):
    """The collate's own log-mel without a floor: clip 9 is padded with silence to the
    batch's length, and its padded frames' mel is log(0) = -inf. An input event on the short
    clip (row 1), and the hint says the -Inf alone is what a log of 0 makes, and where."""
    ev, bundle = fire(train_hifigan, tmp_path, short=[9], floor=False)
    assert (ev["step"], ev["phase"], ev["samples"], ev["kind"]) == (2, "input", [1], "-inf")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["tensor"], o["made"], o["samples"]) == (
        "input", "args[0]", "-inf", [1]), o
    assert rep["cause"] == "input", rep["cause"]
    assert rep["hint"].startswith("args[0] holds -Inf and no NaN or +Inf, which log(0) makes")
    assert "log-mel" in rep["hint"] and "clamp_min(1e-5)" in rep["hint"], rep["hint"]


def test_hook_based_weight_norm_of_a_zero_initialised_conv_names_weight_v(tmp_path):
    """The same zero-initialised last conv under the hook-based torch.nn.utils.weight_norm
    that HiFi-GAN's own code imports (weight_g and weight_v on the conv, g * v / |v| in a
    forward pre-hook): the replay names the op in conv_post, weight_v all 0, and to zero
    weight_g instead."""
    ev, bundle = fire(train_hifigan, tmp_path, "make_generator_zero_post_legacy")
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (
        0, "forward", "conv_post", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"]) == (
        "conv_post", "aten._weight_norm_interface", "nan"), o
    assert o["source"] == line_of("y = torch.tanh(self.conv_post(F.leaky_relu(x)))"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "divides by the norm of conv_post.weight_v, which is all 0" in rep["hint"]
    assert "zero conv_post.weight_g instead" in rep["hint"], rep["hint"]


def test_discriminator_broken_by_its_own_optimizer_is_named_as_the_loss_network(tmp_path):
    """The scale discriminator's head zero-initialised under spectral_norm: its forward in
    the discriminator's update is 0/0, whose NaN gradients the discriminator's AdamW (not the
    recorder's) writes into its weights. The generator's recorded loss then runs the NaN
    discriminator: a loss event at step 0, whose cause is the loss's network's weights, naming
    the first non-finite parameter and saying to record that network with its optimizer."""
    ev, bundle = fire(train_hifigan, tmp_path, zero_disc=True)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (0, "loss", "<loss>", "nan")
    rep = nanreplay_json(bundle)
    assert (rep["origin"]["phase"], rep["origin"]["module"]) == ("loss", "<loss>"), rep["origin"]
    assert rep["cause"] == "weights", rep["cause"]
    hint = rep["hint"]
    assert "the loss holds a network whose parameters are non-finite (6 of 24, first " \
           "disc.discs.2.convs.0.bias)" in hint, hint
    assert "FlightRecorder(disc, its optimizer, ...)" in hint, hint
    assert "class weights" not in hint, hint


def test_discriminator_recorded_names_spectral_norm_of_the_zero_head(tmp_path):
    """Following that advice: the discriminator recorded with its optimizer. The event is in
    the discriminator's first forward, and the replay names spectral_norm's division by the
    zero head's norm and says to initialise it nonzero."""
    gen, disc = M.make_generator(), M.make_discriminator_zero_post()
    opt_d = torch.optim.AdamW(disc.parameters(), 2e-4, betas=(0.8, 0.99))
    loader = torch.utils.data.DataLoader(M.Notes(), batch_size=4, collate_fn=M.collate)
    with pytest.raises(NonFiniteError) as info:
        with recording(disc, opt_d, None, tmp_path, "make_discriminator_zero_post", True):
            for mel, y, lengths in loader:
                opt_d.zero_grad()
                real, fake, _, _ = disc(y.unsqueeze(1), gen(mel, lengths).detach())
                M.discriminator_loss(real, fake).backward()
                opt_d.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"]) == (
        0, "forward", "discs.2.post.parametrizations.weight.0"), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"]) == (
        "discs.2.post.parametrizations.weight.0", "aten.div", "nan"), o
    assert rep["cause"] == "invalid" and "_SpectralNorm parametrization" in rep["hint"]
    assert "weight.original, which is all 0" in rep["hint"], rep["hint"]


def test_pyin_nan_f0_of_unvoiced_frames_is_an_input_event_on_the_record(tmp_path):
    """Record 6's f0 from librosa.pyin, NaN in its unvoiced frames, fed to DDSP as it is: an
    input event on args[0] (the pitch), record 6 alone, and dropping it makes the step
    finite."""
    ev, bundle = fire(train_ddsp, tmp_path, unvoiced=6)
    assert (ev["step"], ev["phase"], ev["tensor"], ev["samples"], ev["kind"]) == (
        3, "input", "args[0]", [6], "nan"), ev
    rep = nanreplay_json(bundle, "--try", "drop=6")
    o = rep["origin"]
    assert (o["phase"], o["tensor"], o["made"], o["samples"]) == ("input", "args[0]", "nan", [6])
    assert rep["cause"] == "input" and "data pipeline" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]
