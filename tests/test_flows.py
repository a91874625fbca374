"""Normalizing flows and VAEs as their repositories train them (``flow_models``): RealNVP's
logit preprocessing and couplings, Glow's 1x1 convolution, a VAE's reparameterisation and KL,
IWAE's importance weights; the recorder on the loop, then ``nanreplay --json`` on its bundle."""

from __future__ import annotations

import json
from pathlib import Path

import flow_models as M
import pytest
import torch
from bundles import nanreplay_json

from recorder import FlightRecorder, NonFiniteError
from recorder.compat import distributions_validate_default


def binarized(step: int, n: int = 8) -> torch.Tensor:
    """A batch of binarized images (MNIST's dynamic binarisation of grey levels)."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.bernoulli(torch.rand(n, M.D_X, generator=g), generator=g)


# (each test starts with torch.distributions' validation on: see conftest)
pytestmark = pytest.mark.usefixtures("in_tests_dir", "validation_at_torch_default")


def train(out_dir: Path, factory: str, loss, batch, steps: int = 5, lr: float = 1e-3,
          call=lambda rec, out, x: rec.loss_fn(out, x), expect=NonFiniteError, **kw):
    """Train ``flow_models.<factory>(**kw)`` on ``batch(step)`` until the recorder (or the
    loop, ``expect``) raises; returns the error."""
    model = getattr(M, factory)(**kw)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    with pytest.raises(expect) as info:
        with FlightRecorder(model, opt, loss_fn=loss, out_dir=out_dir, factory_kwargs=kw,
                            factory=f"flow_models:{factory}") as rec:
            for step in range(steps):
                x = batch(step)
                opt.zero_grad()
                call(rec, model(x), x).backward()
                opt.step()
    return info.value


def test_iwae_samples_stacked_before_the_batch_are_named(tmp_path):
    """IWAE draws K posterior samples per input, ``z`` of shape (K, B, D): the log-weights
    are (K, B). A record loaded without binarisation (grey levels 0..255 where 0/1 belong)
    drives the decoder's sigmoid to exactly 0 at a pixel that is not (log(p) = -inf).
    The event and the report named no sample: only a tensor with the batch in dim 0 (or a
    sequence-first module's dim 1) was read for samples; a value the forward made with the
    batch in dim 1 behind a leading (K) stack now names its samples."""
    K = 3

    def batch(step):
        x = binarized(step)
        if step == K:  # a record whose pixels were left as grey levels
            x[4] = torch.randint(0, 256, (M.D_X,), generator=torch.Generator().manual_seed(7))
        return x

    err = train(tmp_path, "make_iwae", M.iwae_loss, batch,
                call=lambda rec, out, x: rec.loss_fn(out))
    raw = [i for i, row in enumerate(batch(K)) if bool((row > 1).any())]
    assert raw == [4]
    ev = err.event
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (K, "forward", "", raw), ev
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("forward", "", "aten.log", raw, "underflow"), json.dumps(rep, indent=1)
    assert o["source"].startswith("flow_models.py:"), o["source"]
    assert "logsigmoid or BCEWithLogitsLoss on the logits" in rep["hint"], rep["hint"]


def pixels(step: int, n: int = 8) -> torch.Tensor:
    """8-bit grey levels in 1..254 (none at either end)."""
    g = torch.Generator().manual_seed(200 + step)
    return torch.randint(1, 255, (n, M.D_X), generator=g).float()


@pytest.mark.parametrize("torch_logit, op, hint", [
    (True, "aten.logit", "torch.logit(x, eps=1e-6)"),
    (False, "aten.log1p", "keep the input above -1 (x.clamp_min(-1 + eps))")])
def test_realnvp_logit_of_saturated_pixels_says_to_dequantize_not_clamp_min(
        tmp_path, torch_logit, op, hint):
    """RealNVP's preprocessing logit(alpha + (1 - 2 alpha) x) run with alpha = 0 and without
    dequantization noise: two images of step 3 hold a pixel at 255, x = 1 exactly, and the
    logit is +inf there (torch.logit, or log(y) - log1p(-y) written out). Its NaN z then
    fails the loss's Normal.log_prob support check (validate_args): the loop dies with that
    ValueError, the recorder's note names the bundle. The hint said to clamp the op's input
    with x.clamp_min(eps): that moves log1p's -1 to +eps and leaves logit's 1 where it is.
    It now bounds each pole on its side, and for the logit says to dequantize and squash."""
    K = 3

    def batch(step):
        x = pixels(step)
        if step == K:
            x[2, 5] = x[6, 0] = 255.0  # saturated pixels
        return x / 255  # BUG: no dequantization noise, and alpha = 0

    err = train(tmp_path, "make_realnvp", M.flow_nll, batch, expect=ValueError,
                call=lambda rec, out, x: rec.loss_fn(*out), alpha=0.0, torch_logit=torch_logit)
    assert "support" in str(err), err
    [bundle] = tmp_path.glob("*.nan")
    assert any(str(bundle) in n for n in err.__notes__), err.__notes__
    saturated = [i for i, row in enumerate(batch(K)) if bool((row == 1).any())]
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["module"], o["op"], o["samples"],
            rep["cause"]) == (K, "forward", "", op, saturated, "invalid"), \
        json.dumps(rep, indent=1)
    assert o["source"].startswith("flow_models.py:"), o["source"]
    assert hint in rep["hint"] and "clamp_min(eps)" not in rep["hint"], rep["hint"]
    if torch_logit:
        assert "aten.logit of 1" in rep["hint"] and "dequantize" in rep["hint"], rep["hint"]


def per_mille(step: int) -> torch.Tensor:
    """Grey levels in [0, 1]; at step 3, record 5 in per-mille units (0..1000)."""
    x = torch.rand(8, M.D_X, generator=torch.Generator().manual_seed(90 + step))
    if step == 3:
        x[5] *= 1000
    return x


def train_without_validation(tmp_path: Path, factory: str, loss, **kw) -> NonFiniteError:
    """``train`` with torch.distributions' validation off for the process, as a script
    training a Bernoulli decoder on grey levels turns it off (its support check refuses values
    in (0, 1)); put back at torch's default after, as the nanreplay process has it."""
    default = distributions_validate_default()
    torch.distributions.Distribution.set_default_validate_args(False)
    try:
        return train(tmp_path, factory, loss, per_mille, **kw)
    finally:
        torch.distributions.Distribution.set_default_validate_args(default)


def assert_kl_of_the_per_mille_record(err: NonFiniteError) -> None:
    """Record 5's posterior log-variance is below -104: its scale exp(logvar / 2) is 0 in
    float32 and the KL's log of its square is -inf, in the loss."""
    K = 3
    ev = err.event
    assert (ev["step"], ev["phase"]) == (K, "loss"), ev
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    out = [i for i, row in enumerate(per_mille(K)) if bool((row > 1).any())]
    assert (rep["reproduced"], o["phase"], o["module"], o["op"], o["samples"], rep["cause"]) == \
        (True, "loss", "<loss>", "aten.log", out, "underflow"), json.dumps(rep, indent=1)
    assert o["source"].startswith("flow_models.py:"), o["source"]


def test_a_run_with_distributions_validation_off_is_replayed_with_it_off(tmp_path):
    """The VAE's ELBO through torch.distributions, validation off: the nanreplay process,
    validation at its default, re-ran the loss and died in Bernoulli.log_prob's support
    check ('replay failed (ValueError ...)'). The bundle now records the run's default and
    the replay runs with it, then puts its own back."""
    default = distributions_validate_default()
    assert_kl_of_the_per_mille_record(
        train_without_validation(tmp_path, "make_vae", M.distributions_vae_loss))
    assert distributions_validate_default() is default


def test_distributions_a_model_returns_in_a_tuple_reach_the_loss_rerun(tmp_path):
    """A VAE whose forward returns ``(px, qz)``, two torch.distributions objects, and a loss
    called as ``loss_fn(*model(x), x)`` (scvi-tools and Pyro-style code). The bundle held the
    distributions as their repr only (a whole-output distribution was already taken from the
    re-run), and the replay failed: 'UnrebuildableLeaf: Independent ...'. An item of the
    output's tuple, list or dict is now taken from the re-run's output too, by its path."""
    assert_kl_of_the_per_mille_record(train_without_validation(
        tmp_path, "make_dist_vae", M.elbo_loss, call=lambda rec, out, x: rec.loss_fn(*out, x)))


def test_an_infinity_the_forward_put_inside_a_distribution_is_named_in_the_forward(tmp_path):
    """The ``(px, qz)`` VAE with its decoder's temperature annealed linearly to 0 (no floor):
    at step 4 ``logits / tau`` is x/0, +-inf inside the Bernoulli that the forward returns,
    where the instrumented pass saw no tensor. The loss's log_prob makes NaN of it, and the
    report named binary_cross_entropy_with_logits in the loss, 'computed NaN from infinities:
    find the op that made the first infinity', with no chain to follow. The root call's forward
    is now searched for the op that made them: aten.div by the number 0, in the forward, with
    the hint for an annealed temperature. (The recorder reads the distributions' tensors, the
    logits' ±inf as no event by itself: the event is the root's output, whose +inf led to the
    loss's NaN.)"""
    model = M.make_dist_vae()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=M.elbo_loss, out_dir=tmp_path,
                            factory="flow_models:make_dist_vae") as rec:
            for step in range(6):
                model.tau = max(0.0, 1.0 - step / 4)  # BUG: annealed to exactly 0
                x = binarized(step)
                opt.zero_grad()
                rec.loss_fn(*model(x), x).backward()
                opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (4, "forward", ""), \
        err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], o["phase"], o["module"], o["op"], rep["cause"]) == \
        (True, "forward", "", "aten.div", "invalid"), json.dumps(rep, indent=1)
    assert o["samples"] == list(range(8)), o["samples"]  # one tau for every row
    assert o["source"].startswith("flow_models.py:"), o["source"]
    assert "temperature or scale annealed to 0" in rep["hint"], rep["hint"]
    assert any("inside an object of the model output" in p for p in rep["problems"]), rep


def glow_batches(n: int = 40):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(8, 4, 4, 4, generator=g) for _ in range(n)]


def test_glow_diverging_until_its_sigmoid_scale_underflows_says_the_run_diverged(tmp_path):
    """Glow (1x1 convolutions, sigmoid-scaled affine couplings, logdet += log(s)) at a
    learning rate of 0.5: the gradient norm jumps at step 4, the loss at 5, and at step 9 the
    coupling's s = sigmoid(h + 2) is 0 in float32 for two images: log(s) = -inf. The hint
    named the op's remedy only (log space), though the precursors show the run diverging;
    as for an overflow after such growth, it now says so and to lower the learning rate."""
    data = glow_batches()
    err = train(tmp_path, "make_glow", M.flow_nll, lambda step: data[step], steps=len(data),
                lr=0.5, call=lambda rec, out, x: rec.loss_fn(*out))
    K = err.event["step"]
    assert (K, err.event["phase"], err.event["module"]) == (9, "forward", "steps.0"), err.event
    # the same run without the recorder, to step K: where steps.0's s is exactly 0
    model = M.make_glow()
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    for x in data[:K]:
        opt.zero_grad()
        M.flow_nll(*model(x)).backward()
        opt.step()
    with torch.no_grad():
        a, _ = model.steps[0].conv(data[K])[0].chunk(2, 1)
        s = torch.sigmoid(model.steps[0].net(a).chunk(2, 1)[0] + 2)
    zero = [i for i in range(8) if bool((s[i] == 0).any())]
    assert zero, "no underflow planted"
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("forward", "steps.0", "aten.log", zero, "underflow"), json.dumps(rep, indent=1)
    assert "logsigmoid" in rep["hint"], rep["hint"]
    assert "the run was diverging" in rep["hint"] and "lower the learning rate" in rep["hint"], \
        rep["hint"]


def test_a_half_model_output_whose_sigmoid_rounded_to_1_gets_the_float32_try(tmp_path):
    """The VAE's forward under float16 autocast, its hand-written Bernoulli likelihood run by
    the loop outside autocast on the float16 logits it returns: a record 100x brighter drives
    sigmoid to 1 in float16 (0.99977 in float64), log(1 - p) is -inf. The report said
    precision in float16, but --try auto offered drop only: it proposed dtype=float32 for a
    loss origin only when the loss call itself ran under autocast. The loss origin now gives
    the type its op computed in, and a half one gets dtype=float32, which re-runs finite."""
    K = 3
    model = M.make_vae()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=M.handwritten_bce_vae_loss, out_dir=tmp_path,
                            factory="flow_models:make_vae") as rec:
            for step in range(6):
                g = torch.Generator().manual_seed(90 + step)
                x = (torch.rand(8, M.D_X, generator=g) > 0.5).float()
                bright = x.clone()
                if step == K:
                    bright[5] *= 100  # a record 100x brighter
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16):
                    out = model(bright)
                rec.loss_fn(out, x).backward()
                opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (K, "loss"), err.event
    rep = nanreplay_json(err.bundle_path, "--try", "auto")
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"], o["dtype"], rep["cause"]) == \
        ("loss", "<loss>", "aten.log", [5], "float16", "precision"), json.dumps(rep, indent=1)
    assert "binary_cross_entropy_with_logits" in rep["hint"], rep["hint"]
    tries = {t["try"]: t["finite"] for t in rep["what_if"]}
    assert tries == {"drop=5": True, "dtype=float32": True}, rep["what_if"]
