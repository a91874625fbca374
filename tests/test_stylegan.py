"""StyleGAN2-ADA training (NVlabs/stylegan2-ada-pytorch's ``training_loop`` and
``StyleGAN2Loss``) under the recorder, given G's or D's optimizer.

Each iteration runs the phases Gmain, Greg (lazy path-length regularization, every 4), Dmain,
Dreg (lazy R1, every 16), each with its own ``zero_grad``/``backward``/``step``; G and D have
their own Adam with betas (0, 0.99) scaled by the lazy ratio, G_ema is updated in place and
ADA's ``p`` follows the sign of D's real logits. Recorded on G, the Gmain and Greg updates are
steps of their own, and the Dmain phase's generator forward (G frozen) opens the next step,
whose second micro-batch is the next Gmain's.

Planted bugs:
- the demodulation without its eps (``rsqrt((w ** 2).sum([2,3,4]))``) and the style affine's
  bias started at 0, so a latent of 0 gives a style of 0 and ``rsqrt(0)``. The report blamed
  the bias as 'a layer of zeros that outputs 0 for every input', though 7 of 8 samples were
  finite with it: it now says the divisor is 0 in sample 3 only and to add the eps.
- the same, recorded on D: the input event on G's images named no samples (a tensor with a
  graph was skipped as the model's own output) and its hint called them an image the loop
  trains (DeepDream's); it now names sample 3 and the network that made them.
- ``conv_clamp=0`` meant as 'off': every image is clamped to 0, the path-length gradient
  ``autograd.grad((img * noise).sum(), ws)`` is exactly 0 and ``sqrt`` of it backpropagates
  NaN. The report said 'cause unknown, pass loss_fn', and that the loop 'spread the value
  after backward (a clip_grad_norm_ ...)', a clip this loop never had: the other parameters'
  NaN came through the derivative's own graph. It now takes that derivative in the re-run,
  finds it exactly 0 in every sample, and says so (cause invalid). With ADA's own
  ``nan_to_num`` of every gradient before the update, the recorder still caught the NaN
  entering ``ws``, but the replay said 'NOT reproduced' because the recorded parameter
  gradients were the scrubbed zeros: it now tells the scrub (0 where the re-run's are NaN).
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import stylegan_models as M
import torch
import torch.nn.functional as F
from bundles import line_number, nanreplay_json

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

B, ZERO_ROW = 8, 3
G_REG, D_REG = 4, 16


def adam(params, reg_interval):
    ratio = reg_interval / (reg_interval + 1)  # ADA's lazy regularization: lr and betas
    return torch.optim.Adam(params, lr=0.0025 * ratio, betas=(0.0, 0.99 ** ratio), eps=1e-8)


def opt_step(opt, scrub=True):
    """ADA's training_loop: every gradient through nan_to_num before the update (fp16 layers'
    infinities), which would hide the NaN from a check made in the step's pre-hook."""
    for group in opt.param_groups if scrub else ():
        for param in group["params"]:
            if param.grad is not None:
                torch.nan_to_num(param.grad, nan=0, posinf=1e5, neginf=-1e5, out=param.grad)
    opt.step()


def train(iters, make_g=M.make_generator, record=None, zero_latent_at=None, out_dir=None,
          scrub=True, corrupt_at=None):
    """The phases of one StyleGAN2-ADA iteration; ``record``: "G" or "D" (the module and
    optimizer given to the recorder)."""
    torch.manual_seed(0)
    G, D = make_g(), M.make_discriminator()
    G_ema = make_g().eval().requires_grad_(False)
    G_ema.load_state_dict(G.state_dict())
    G_opt, D_opt = adam(G.parameters(), G_REG), adam(D.parameters(), D_REG)
    ada_p, ada_target, aug = 0.0, 0.6, torch.Generator().manual_seed(5)
    signs, pl_mean = [], torch.zeros([])
    if record == "G":
        rec = FlightRecorder(G, G_opt, out_dir=out_dir,
                             factory=f"stylegan_models:{make_g.__name__}")
    elif record == "D":
        rec = FlightRecorder(D, D_opt, out_dir=out_dir,
                             factory="stylegan_models:make_discriminator")
    else:
        rec = None
    with rec or contextlib.nullcontext():
        for it in range(iters):
            reals = M.real_images(it, B)
            if it == corrupt_at:
                reals[ZERO_ROW, 1] = float("nan")  # a corrupt image in the dataset
            # Gmain: the non-saturating logistic loss, with style mixing
            G.requires_grad_(True)
            D.requires_grad_(False)
            G_opt.zero_grad(set_to_none=True)
            z = torch.randn(B, M.Z_DIM)
            if it == zero_latent_at:
                z[ZERO_ROW] = 0  # a latent batch padded with a zero row
            if torch.rand([]) < 0.9:
                cutoff = int(torch.randint(1, M.NUM_WS, ()))
                fake = G(z, torch.randn(B, M.Z_DIM), mixing_cutoff=cutoff)
            else:
                fake = G(z)
            F.softplus(-D(M.augment(fake, ada_p, aug))).mean().backward()
            opt_step(G_opt, scrub)
            if it % G_REG == 0:  # Greg: path-length regularization, its own update
                G_opt.zero_grad(set_to_none=True)
                img, ws = G(torch.randn(B // 2, M.Z_DIM), return_latents=True)
                pl_noise = torch.randn_like(img) / np.sqrt(img.shape[2] * img.shape[3])
                pl_grads, = torch.autograd.grad(outputs=[(img * pl_noise).sum()], inputs=[ws],
                                                create_graph=True)
                pl_lengths = pl_grads.square().sum(2).mean(1).sqrt()
                pl_mean = pl_mean.lerp(pl_lengths.mean().detach(), 0.01)
                loss_Gpl = (pl_lengths - pl_mean).square() * 2.0
                (img[:, 0, 0, 0] * 0 + loss_Gpl).mean().mul(G_REG).backward()
                opt_step(G_opt, scrub)
            # Dmain
            G.requires_grad_(False)
            D.requires_grad_(True)
            D_opt.zero_grad(set_to_none=True)
            gen_logits = D(M.augment(G(torch.randn(B, M.Z_DIM)), ada_p, aug))
            real_logits = D(M.augment(reals, ada_p, aug))
            signs.append(real_logits.detach().sign().mean())
            (F.softplus(gen_logits) + F.softplus(-real_logits)).mean().backward()
            opt_step(D_opt, scrub)
            if it % D_REG == 0:  # Dreg: lazy R1 on the reals, its own update
                D_opt.zero_grad(set_to_none=True)
                real_img = M.augment(reals, ada_p, aug).detach().requires_grad_(True)
                real_logits = D(real_img)
                r1_grads, = torch.autograd.grad(outputs=[real_logits.sum()],
                                                inputs=[real_img], create_graph=True)
                r1_penalty = r1_grads.square().sum([1, 2, 3])
                (real_logits * 0 + r1_penalty * (1.0 / 2)).mean().mul(D_REG).backward()
                opt_step(D_opt, scrub)
            with torch.no_grad():  # G_ema, in place
                for p_ema, p in zip(G_ema.parameters(), G.parameters()):
                    p_ema.copy_(p.lerp(p_ema, 0.9))
                for b_ema, b in zip(G_ema.buffers(), G.buffers()):
                    b_ema.copy_(b)
            if it % 4 == 3:  # ADA: p follows the sign of D's real logits
                adjust = np.sign(float(torch.stack(signs).mean()) - ada_target) * B * 4 / 100
                ada_p, signs = max(ada_p + adjust, 0.0), []
    return G, D, G_ema, rec


def same_state(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                  b.state_dict().values()))


@pytest.mark.parametrize("record", ["G", "D"])
def test_healthy_training_raises_nothing_and_trains_the_same(record, tmp_path):
    iters = 6  # Greg at 0 and 4, Dreg at 0, ADA's p updated at 3
    plain = train(iters)
    recorded = train(iters, record=record, out_dir=tmp_path)
    assert not list(tmp_path.iterdir())
    for a, b in zip(plain[:3], recorded[:3]):
        assert same_state(a, b)
    # on G: a step per Gmain and per Greg update; each Dmain generator forward opens the next
    # Gmain's step (the last one, which no backward reached, is checked at the with block's
    # exit as an evaluation, not counted). On D: Gmain's D forward opens the step Dmain's
    # update closes, and a step per Dreg update
    expected = iters + len(range(0, iters, G_REG)) if record == "G" else \
        iters + len(range(0, iters, D_REG))
    assert recorded[3].step == expected


def test_demodulation_without_eps_names_the_zero_style_sample(tmp_path):
    with pytest.raises(NonFiniteError) as info:
        train(3, M.make_generator_no_eps, record="G", zero_latent_at=0, out_dir=tmp_path)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["micro_batch"], ev["samples"]) == \
        (0, "forward", "synthesis.b4_conv1", 0, [ZERO_ROW])
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert rep["reproduced"] and rep["cause"] == "invalid"
    assert (o["op"], o["module"], o["made"], o["samples"]) == \
        ("aten.rsqrt", "synthesis.b4_conv1", "+inf", [ZERO_ROW])
    assert o["source"] == "stylegan_models.py:" + str(
        line_number("stylegan_models.py", "dcoefs = (w.square()"))
    hint = rep["hint"]
    # the zero bias alone is no layer of zeros: the other 7 samples were finite with it
    assert f"samples [{ZERO_ROW}] only" in hint and "synthesis.b4_conv1.affine.bias" in hint
    assert "eps" in hint and "layer of zeros (zero-initialised" not in hint


def test_zero_style_is_an_input_to_the_discriminator(tmp_path):
    """Recorded on D, the generator's NaN comes in with the fakes: an input event on the
    Gmain phase's D forward, which opens D's step 0."""
    with pytest.raises(NonFiniteError) as info:
        train(3, M.make_generator_no_eps, record="D", zero_latent_at=0, out_dir=tmp_path)
    ev = info.value.event
    # (the fakes come with G's graph: once skipped as 'the model's output', no samples)
    assert (ev["step"], ev["phase"], ev["micro_batch"], ev["tensor"], ev["samples"]) == \
        (0, "input", 0, "batch", [ZERO_ROW])
    rep = nanreplay_json(info.value.bundle_path)
    assert rep["reproduced"] and rep["cause"] == "input"
    assert rep["origin"]["samples"] == [ZERO_ROW]
    # another network's output, not an image the loop trains (style transfer's, DeepDream's)
    assert "autograd graph" in rep["hint"] and "generator" in rep["hint"]
    assert "DeepDream" not in rep["hint"]


@pytest.mark.parametrize("scrub", [True, False])
def test_path_length_of_a_zero_gradient_is_named(scrub, tmp_path):
    """``scrub``: ADA's nan_to_num of the gradients before each update (the recorder still
    sees the NaN gradient entering ``ws``), or a loop without it."""
    with pytest.raises(NonFiniteError) as info:
        train(3, M.make_generator_clamp0, record="G", out_dir=tmp_path, scrub=scrub)
    ev = info.value.event
    # step 0 is iteration 0's Gmain update; its Greg update is step 1
    assert (ev["step"], ev["phase"]) == (1, "backward")
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert rep["reproduced"] and rep["cause"] == "invalid"
    assert (o["tensor"], o["micro_batch"], o["samples"]) == \
        ("grad of the model output 1", 0, list(range(B // 2)))
    assert "output 0 with respect to output 1" in rep["hint"]
    assert f"exactly 0 in every sample ({B // 2})" in rep["hint"]
    notes = " ".join(rep["problems"])
    assert "clip_grad_norm_" not in notes
    # scrubbed, the recorded gradients are 0 where the re-run's are NaN (not 'not reproduced');
    # else more are NaN than the output gradient gives: the derivative's own graph, no clip
    assert ("nan_to_num" in notes) == scrub
    assert ("reaches the parameters directly" in notes) == (not scrub)


def test_corrupt_real_image_on_the_discriminator(tmp_path):
    """On D, an iteration is one step of three micro-batches (Gmain's D forward on the fakes,
    Dmain's on the fakes, then on the reals) and Dreg's update one step more at iteration 0:
    iteration 2's reals are step 3's micro-batch 2."""
    with pytest.raises(NonFiniteError) as info:
        train(4, record="D", corrupt_at=2, out_dir=tmp_path)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["micro_batch"], ev["samples"]) == \
        (3, "input", 2, [ZERO_ROW])
    rep = nanreplay_json(info.value.bundle_path)
    assert rep["reproduced"] and rep["cause"] == "input"
    assert rep["origin"]["samples"] == [ZERO_ROW]
    assert "autograd graph" not in rep["hint"]  # (data, not another network's output)
