"""End to end: learned image compression written the way CompressAI writes it
(``learned_compression_models``: GDN, the factorized ``EntropyBottleneck``, the hyperprior's
``GaussianConditional``, the rate-distortion loss as a dict, a main and an auxiliary optimizer
with ``clip_grad_norm_``, as ``examples/train.py`` trains them), trained under the recorder
until a planted bug fires, then replayed with the CLI."""

from __future__ import annotations

import learned_compression_models as M
import pytest
import torch
from bundles import line_number, nanreplay_json
from torch.utils.data import DataLoader, TensorDataset

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> int:
    return line_number("learned_compression_models.py", text)


def train(out_dir, factory: str, steps: int = 6, edit=None, losses=None, lr=1e-2, epochs=1,
          amp=False, **recorder) -> NonFiniteError | None:
    """CompressAI's ``train_one_epoch`` and ``test_epoch``: the main Adam on everything but
    the quantiles, the aux Adam on the quantiles stepped after it on ``aux_loss()``, the
    gradients clipped to norm 1, then an evaluation under ``no_grad`` (rounding, not noise)
    whose loss ``ReduceLROnPlateau`` steps on. ``edit(images)`` plants a bad batch; ``amp``:
    float16 autocast with a GradScaler, unscaled before the clip."""
    model = getattr(M, factory)()
    optimizer, aux_optimizer = M.configure_optimizers(model, lr=lr)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, "min")
    criterion = M.RateDistortionLoss(lmbda=1e-2)
    data, test = M.images(M.BATCH * steps), M.images(M.BATCH, seed=1)
    if edit is not None:
        edit(data)
    loader = DataLoader(TensorDataset(data), batch_size=M.BATCH, shuffle=False)
    scaler = torch.amp.GradScaler("cpu", enabled=amp)
    try:
        with FlightRecorder(model, optimizer, loss_fn=criterion, out_dir=out_dir,
                            factory=f"learned_compression_models:{factory}",
                            **({"scaler": scaler} if amp else {}), **recorder):
            for _ in range(epochs):
                model.train()
                for (d,) in loader:
                    optimizer.zero_grad()
                    aux_optimizer.zero_grad()
                    with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
                        out_criterion = criterion(model(d), d)
                    scaler.scale(out_criterion["loss"]).backward()
                    if losses is not None:
                        losses.append(out_criterion["loss"].item())
                    scaler.unscale_(optimizer)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    scaler.step(optimizer)
                    scaler.update()
                    aux_loss = model.aux_loss()
                    aux_loss.backward()
                    aux_optimizer.step()
                model.eval()
                with torch.no_grad():
                    scheduler.step(criterion(model(test), test)["loss"].item())
    except NonFiniteError as e:
        return e
    return None


@pytest.mark.parametrize("factory", ["make_hyperprior", "make_mean_scale"])
def test_healthy_hyperpriors_train_without_an_event(tmp_path, factory):
    # the aux optimizer updates the quantiles outside the recorded optimizer, on a second
    # backward after the recorded step closed; the likelihoods' LowerBound passes gradients
    # through a custom autograd.Function: none of it is an event
    assert train(tmp_path, factory, steps=4, epochs=2) is None
    assert not list(tmp_path.glob("*.nan"))


def test_scales_without_their_lower_bound_ask_for_the_bound_not_a_mask(tmp_path):
    # GaussianConditional without LowerBound(0.11) divides by the scales h_s ends with a ReLU:
    # where it is 0, (0.5 - |y|) / 0 is +-inf, erfc makes it 0 or 2 and the likelihood 1, so
    # the forward is finite; DivBackward0's gradient is -g * a / 0 ** 2 = 0 * inf = NaN
    err = train(tmp_path, "make_hyperprior_no_scale_bound")
    assert (err.event["step"], err.event["phase"]) == (0, "backward")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "invalid", "gaussian_conditional", "DivBackward0", "nan", list(range(M.BATCH))), rep
    assert o["source"] == f"learned_compression_models.py:{line_of('(-half - values) / scales')}"
    # (was: "make the op's input safe before the op (torch.where(mask, x, 1)) or add an eps",
    # a mask for a value nothing masks, and no word that the ReLU'd scale needs a bound)
    assert "ReLU" in rep["hint"] and "bound it below" in rep["hint"], rep["hint"]
    assert "clamp_min" in rep["hint"] and "torch.where" not in rep["hint"], rep["hint"]


def test_negative_scales_without_any_bound_are_a_log_of_a_negative_likelihood(tmp_path):
    # the mean-scale h_s ends with a conv: its scales are negative where the bound is gone,
    # upper - lower of the CDFs then is negative, and without the likelihood's LowerBound the
    # loss's log takes it
    err = train(tmp_path, "make_mean_scale_unbounded")
    assert (err.event["step"], err.event["phase"]) == (0, "loss")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "invalid", "<loss>", "aten.log", "nan", list(range(M.BATCH))), rep
    assert o["source"] == f"learned_compression_models.py:{line_of('torch.log(likelihoods)')}"
    assert "negative" in rep["hint"] and "domain" in rep["hint"], rep["hint"]
    # (was: only "clamp the op's input into its domain (x.clamp_min(eps) before log)", which
    # is the likelihood bound and hides the negative scales: the hint now says where the
    # negative likelihoods were made)
    made = ("the model's output['likelihoods']['y'], which module gaussian_conditional "
            "returned, made by aten.sub")
    assert made in rep["hint"], rep["hint"]


def test_likelihoods_without_their_bound_replay_the_clipped_window_as_trained(tmp_path):
    # without the likelihoods' LowerBound(1e-9), the Gaussian's upper - lower of two erfc
    # tails, positive in exact arithmetic, rounds to 0 as the rate term pushes y out: log(0)
    losses: list[float] = []
    err = train(tmp_path, "make_hyperprior_no_likelihood_bound", losses=losses, rewind=2)
    assert (err.event["step"], err.event["phase"]) == (3, "loss")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "underflow", "<loss>", "aten.log", "-inf", [1, 2, 3]), rep
    assert o["source"] == f"learned_compression_models.py:{line_of('torch.log(likelihoods)')}"
    assert "clamp_min(eps)" in rep["hint"], rep["hint"]
    # (was: no word of where the 0s were made; the bound belongs in the entropy model)
    made = ("The 0s are the model's output['likelihoods']['y'], which module "
            "gaussian_conditional returned, made by aten.sub: bound it where it is made")
    assert made in rep["hint"], rep["hint"]
    w = rep["window"]
    # every recorded update was clipped to norm 1 (clip_grad_norm_): the re-run re-applies it.
    # (was: the loss the ring records of a dict of terms, their mean, compared with the
    # re-run's total, so no clip, gradient norm 325 and "the window's re-run is not the run:
    # state the loop changed after the window's copy", a cause that was not there)
    assert (w["reproduced"], w.get("departed")) == (True, None), w
    assert w["loop_clip"] == pytest.approx(1.0, rel=1e-6), w
    assert not any("is not the run" in p for p in rep["problems"]), rep["problems"]
    # the window's losses are the loop's: the dict's "loss", not "loss" + "bpp_loss" +
    # "mse_loss" (was: 148.94 for 148.27), and the loss event's kind is the term's +inf
    per_step = [s["loss"] for s in w["per_step"][:3]]
    assert per_step == pytest.approx(losses[:3], rel=1e-5), (per_step, losses)
    assert (w["first_non_finite"]["step"], w["first_non_finite"]["kind"]) == (3, "+inf"), w


def test_gdn_without_its_reparameterization_names_the_negative_gamma(tmp_path):
    # GDN re-implemented with beta and gamma learned as they are: Adam steps off-diagonal
    # entries of the inverse GDN's gamma below 0 and conv2d(x ** 2, gamma, beta) goes negative
    err = train(tmp_path, "make_hyperprior_raw_gdn", lr=3e-2)
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (3, "forward", "g_s.1")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "invalid", "g_s.1", "aten.sqrt", "nan", list(range(M.BATCH))), rep
    assert o["source"] == f"learned_compression_models.py:{line_of('norm = torch.sqrt(norm)')}"
    # (was: "clamp the op's input into its domain (x.clamp_min(eps) before log or sqrt)",
    # which hides the negative weights instead of keeping them non-negative)
    assert "g_s.1.gamma (min -" in rep["hint"], rep["hint"]
    assert "NonNegativeParametrizer" in rep["hint"] and "g_s.1.beta" not in rep["hint"], rep
    assert "x.clamp_min(eps)" not in rep["hint"], rep["hint"]


def test_unscaled_16_bit_image_under_float16_autocast_is_named_as_data(tmp_path):
    # a 16-bit crop loaded without its / 65535 in a float16 autocast run: GDN's x ** 2
    # overflows float16 in that sample, and conv2d's 0 * inf (gamma's zero off-diagonal)
    # makes NaN
    def unscaled(images):
        images[9].mul_(65535)

    err = train(tmp_path, "make_hyperprior", edit=unscaled, amp=True)
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (2, "forward", "g_a.1")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "overflow", "g_a.1", "aten.pow", "+inf", [1]), rep
    assert o["source"] == f"learned_compression_models.py:{line_of('F.conv2d(x ** 2, gamma')}"
    assert "float16" in rep["hint"] and "out of scale" in rep["hint"], rep["hint"]
    assert "--try drop=1" in rep["hint"], rep["hint"]
