"""End to end: diffusion training with the real Hugging Face diffusers library
(``diffusers_training_models``: a tiny ``UNet2DConditionModel`` built from arguments, DDPM's
``add_noise``, epsilon or v targets, min-SNR-gamma weighting, classifier-free guidance dropout,
AdamW under diffusers' cosine schedule, ``EMAModel``, clipping, bf16 autocast) under the flight
recorder until a planted failure of the domain fires, replayed with the CLI."""

from __future__ import annotations

import pytest

pytest.importorskip("diffusers")

import diffusers_training_models as M  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from bundles import nanreplay_json, source_line  # noqa: E402
from diffusers.optimization import get_cosine_schedule_with_warmup  # noqa: E402
from diffusers.training_utils import EMAModel  # noqa: E402

from recorder import FlightRecorder, NonFiniteError  # noqa: E402

pytestmark = [pytest.mark.usefixtures("in_tests_dir"),
              pytest.mark.filterwarnings("ignore:.*should be kept in float32")]

FACTORY = "diffusers_training_models:make_unet"


class Mse(torch.nn.Module):
    """The scripts' plain ``F.mse_loss(model_pred.float(), target.float())``."""

    def forward(self, pred, target, timesteps):
        return F.mse_loss(pred.float(), target.float())


def train(tmp_path, data, loss_fn=None, steps=8, eps=1e-8, zero_snr=False, gamma=None,
          prediction_type="epsilon", cfg=0.1, drop_all_at=None, amp=torch.bfloat16, seed=1,
          record=True):
    """``train_text_to_image.py``'s step: noise, a uniform timestep, ``add_noise``, the
    prediction target, CFG dropout (zeroed states), the UNet under autocast, the loss, clipping,
    AdamW, the cosine schedule, the EMA."""
    model = M.make_unet()
    sched = M.make_scheduler(zero_snr, prediction_type)
    loss_fn = M.MinSnrLoss(sched, gamma) if gamma is not None else loss_fn or Mse()
    loss_fn = M.X0Loss(sched) if loss_fn == "x0" else loss_fn
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=eps)
    lr_sched = get_cosine_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=steps)
    ema = EMAModel(model.parameters(), decay=0.999)
    g = torch.Generator().manual_seed(seed)
    rec = FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=tmp_path / "b",
                         factory=FACTORY) if record else None
    with rec or torch.enable_grad():
        for i, b in enumerate(data):
            if i >= steps:
                break
            latents, ehs = b["pixel_values"], b["encoder_hidden_states"]
            noise = torch.randn(latents.shape, generator=g)
            t = torch.randint(0, M.T, (len(latents),), generator=g)
            keep = (torch.rand(len(latents), generator=g) >= cfg).float()[:, None, None]
            ehs = ehs * (keep if drop_all_at != i else 0.0)
            noisy = sched.add_noise(latents, noise, t)
            target = noise if prediction_type == "epsilon" else sched.get_velocity(latents,
                                                                                  noise, t)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=amp):
                pred = model(noisy, t, encoder_hidden_states=ehs).sample
            extra = (noisy, latents) if isinstance(loss_fn, M.X0Loss) else ()
            loss = loss_fn(pred, target, t, *extra)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            lr_sched.step()
            ema.step(model.parameters())
    return model, ema


def fire(tmp_path, data, **kw):
    with pytest.raises(NonFiniteError) as info:
        train(tmp_path, data, **kw)
    return nanreplay_json(info.value.bundle_path, "--json", code=None)


def origin(rep):
    o = rep["origin"]
    return o["phase"], o["module"], o["op"], rep["event"]["step"], rep["cause"]


def test_healthy_run_raises_nothing_and_trains_identically(tmp_path):
    """v-prediction under min-SNR weighting, CFG dropout, bf16 autocast, EMA: no event, the
    same weights and EMA bit for bit with and without the recorder."""
    runs = [train(tmp_path / str(r), M.loader(24), gamma=5.0, prediction_type="v_prediction",
                  steps=6, record=r) for r in (False, True)]
    (a, ea), (b, eb) = runs
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert all(torch.equal(p, q) for p, q in zip(ea.shadow_params, eb.shadow_params))
    assert not list((tmp_path / "True" / "b").glob("*.nan"))


def test_a_nan_image_in_the_batch(tmp_path):
    """Image 13 decoded with NaN (a truncated file): the model's input, step 3, sample 1."""
    rep = fire(tmp_path, M.loader(32, bad=(13,)))
    assert origin(rep) == ("input", None, None, 3, "input")
    assert rep["origin"]["tensor"] == "args[0]" and rep["origin"]["samples"] == [1]


def test_min_snr_weighting_over_a_zero_terminal_snr_schedule(tmp_path):
    """rescale_betas_zero_snr with epsilon prediction: alphas_cumprod[99] is 0, so the SNR of
    the sample drawn t = 99 (step 5, sample 2) is 0 and min(snr, gamma) / snr is 0/0. The hint
    names the loss's schedule buffer and its last entry (before: "a record of the samples named
    is degenerate ... repair it where the data is made", since the divisor, an SNR squared from
    the looked-up entry, was not followed as the table's)."""
    rep = fire(tmp_path, M.loader(32), gamma=5.0, zero_snr=True, seed=11)
    assert origin(rep) == ("loss", "<loss>", "aten.div", 5, "invalid")
    assert rep["origin"]["samples"] == [2]
    assert rep["origin"]["source"] == source_line(
        "diffusers_training_models.py", "weights = weights / snr")
    assert "looked up in the buffer <loss>.alphas_cumprod" in rep["hint"]
    assert "0 at its last entry (99)" in rep["hint"]
    assert "rescaled to zero terminal SNR" in rep["hint"]
    assert "min(snr, gamma) / snr, an SNR of 0 there, predict v" in rep["hint"]


def test_unnormalised_text_states_overflow_float16_cross_attention(tmp_path):
    """Text-encoder states ~3e4 (no final layer norm) under float16 autocast: the cross-
    attention's key projection casts them past 65504 at step 0; sample 0's states were dropped
    to zeros by CFG, so samples 1-3."""
    rep = fire(tmp_path, M.loader(32, scale=3e4), amp=torch.float16)
    assert origin(rep) == ("forward", M.ATTN2_K, "aten._to_copy", 0, "overflow")
    assert rep["origin"]["samples"] == [1, 2, 3]
    # (three of four samples: the data's scale, not records out of the others' scale, which
    # sample 0's zeros are no measure of)
    assert "rescale such records where the data is made" in rep["hint"], rep["hint"]


def test_adamw_eps_zero_after_a_whole_batch_dropped_its_conditioning(tmp_path):
    """The first batch's conditioning all dropped (CFG applied per batch) leaves the
    cross-attention's key and value projections gradients of exactly 0; AdamW with eps=0
    makes 0/0 of them at its first update."""
    rep = fire(tmp_path, M.loader(32), eps=0.0, drop_all_at=0)
    assert rep["cause"] == "optimizer" and rep["event"]["step"] == 0
    assert rep["origin"]["phase"] == "optimizer"
    assert M.ATTN2_K + ".weight" in rep["origin"]["params"]
    assert "eps=0" in rep["hint"] and "set eps > 0" in rep["hint"]


def test_an_x0_image_loss_over_a_zero_terminal_snr_schedule(tmp_path):
    """The predicted clean sample divided by sqrt(alphas_cumprod[t]), 0 at t = 99 of a
    zero-terminal-SNR schedule (step 5, sample 2): x/0 in the loss."""
    rep = fire(tmp_path, M.loader(32), loss_fn="x0", zero_snr=True, seed=11)
    assert origin(rep) == ("loss", "<loss>", "aten.div", 5, "invalid")
    assert rep["origin"]["samples"] == [2]
    assert rep["origin"]["source"] == source_line(
        "diffusers_training_models.py", "x0 = (noisy - (1 - a).sqrt()")
    assert "looked up in the buffer <loss>.alphas_cumprod" in rep["hint"]
