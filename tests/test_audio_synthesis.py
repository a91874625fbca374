"""End to end on neural audio synthesis (``audio_synthesis_models``): DDSP's harmonic-plus-noise
autoencoder under its multi-scale spectral loss (Adam, exponential decay, clipping), HiFi-GAN's
generator and discriminators with two optimizers (least-squares, feature-matching and mel-L1
losses, ExponentialLR as the reference recipe), and a WaveNet's 256-way softmax over mu-law
classes. Each planted bug of the domain fires under the recorder and is replayed with the CLI;
the healthy versions raise no event and train bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib
import itertools

import audio_synthesis_models as M
import pytest
import torch
import torch.nn.functional as F
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
            loss = crit(model(f0, loud), audio)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
    return model


def train_hifigan(out_dir, make: str = "make_generator", *, steps: int = 3, record: bool = True):
    """HiFi-GAN's train.py: AdamW(0.8, 0.99) for each network, the discriminator's update on the
    detached fake, then the generator's on 45 x mel L1 + feature matching + adversarial; the
    recorder is given the generator and its optimizer."""
    gen, disc = getattr(M, make)(), M.Discriminator()
    opt_g = torch.optim.AdamW(gen.parameters(), 2e-4, betas=(0.8, 0.99))
    opt_d = torch.optim.AdamW(disc.parameters(), 2e-4, betas=(0.8, 0.99))
    scheds = [torch.optim.lr_scheduler.ExponentialLR(o, 0.999) for o in (opt_g, opt_d)]
    g = torch.Generator().manual_seed(0)
    with recording(gen, opt_g, None, out_dir, make, record):
        for _ in range(steps):
            mel, y = M.vocoder_batch(g)
            y = y.unsqueeze(1)
            y_g_hat = gen(mel)
            opt_d.zero_grad()
            real, fake, _, _ = disc(y, y_g_hat.detach())
            M.discriminator_loss(real, fake).backward()
            opt_d.step()

            opt_g.zero_grad()
            loss_mel = F.l1_loss(mel, M.mel_spectrogram(y_g_hat.squeeze(1))) * 45
            _, fake, fmap_r, fmap_g = disc(y, y_g_hat)
            loss = M.generator_loss(fake) + M.feature_loss(fmap_r, fmap_g) + loss_mel
            loss.backward()
            opt_g.step()
            for s in scheds:
                s.step()
    return gen, disc


def train_wavenet(out_dir, *, steps: int = 4, record: bool = True, accumulate: int = 2):
    """Teacher-forced WaveNet: cross-entropy over 256 mu-law classes, Adam with a step decay,
    two micro-batches accumulated per update."""
    model = M.make_wavenet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    crit = torch.nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(0)
    with recording(model, opt, crit, out_dir, "make_wavenet", record):
        for _, k in itertools.product(range(steps), range(accumulate)):
            x, y = M.wavenet_batch(g)
            (crit(model(x), y) / accumulate).backward()
            if k == accumulate - 1:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
                sched.step()
    return model


def same_weights(a: torch.nn.Module, b: torch.nn.Module):
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name


def test_healthy_ddsp_raises_nothing_and_trains_the_same(tmp_path):
    """exp_sigmoid's floor, the Nyquist mask's + 1e-4 and the spectral loss's eps: a record
    whose pitch tracker jumped above Nyquist and a clip padded with digital silence raise no
    event, and the weights are bit-identical with and without the recorder (the noise's
    torch.rand draws the same)."""
    recorded = train_ddsp(tmp_path, glitch=3, padded=5)
    plain = train_ddsp(tmp_path, glitch=3, padded=5, record=False)
    assert not list(tmp_path.glob("*.nan"))
    same_weights(recorded, plain)


def test_healthy_hifigan_raises_nothing_and_trains_the_same(tmp_path):
    """weight_norm and spectral_norm parametrizations, two optimizers, the discriminator run
    on the detached fake then again for the generator: no event, the same weights."""
    recorded = train_hifigan(tmp_path)
    plain = train_hifigan(tmp_path, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for a, b in zip(recorded, plain):
        same_weights(a, b)


def test_healthy_wavenet_raises_nothing_and_trains_the_same(tmp_path):
    recorded = train_wavenet(tmp_path)
    plain = train_wavenet(tmp_path, record=False)
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
    assert o["source"] == line_of("return torch.tanh(self.conv_post(F.leaky_relu(x)))"), o
    assert rep["cause"] == "invalid" and "original1, which is all 0" in rep["hint"]
    assert "zero its magnitude original0" in rep["hint"], rep["hint"]
