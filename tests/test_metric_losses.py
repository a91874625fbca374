"""Losses built from metric libraries (``metric_losses_models.py``): torchmetrics 1.9's
functional MS-SSIM, PSNR, RMSE, Pearson, KL divergence and total variation inside user-defined
loss modules, pytorch-msssim's ``SSIM`` module in a combined L1 + (1 - SSIM) + perceptual
loss, a torchmetrics ``Metric`` updated in the loop. Each planted failure is recorded as a user
records it and ``nanreplay --json`` must name its step, module, op, samples and cause; the
healthy run raises no event and trains bit-identically with and without the recorder."""

from __future__ import annotations

import json

import metric_losses_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line
from torchmetrics.image import PeakSignalNoiseRatio

from recorder import FlightRecorder, NonFiniteError

pytestmark = [pytest.mark.usefixtures("in_tests_dir"),
              pytest.mark.filterwarnings("ignore::UserWarning")]

MODELS = "metric_losses_models.py"


def _loader(a, b):
    return torch.utils.data.DataLoader(M.Pairs(a, b), batch_size=4)


def _train(model, crit, loader, *, out_dir=None, factory=None, epochs=2, amp=None):
    """Adam over ``loader`` with ``crit`` (recorded when ``out_dir`` is given), a PSNR metric
    object updated each step; returns the recorder's error, or the final weights."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    metric = PeakSignalNoiseRatio(data_range=1.0)

    def loop(loss_fn):
        for _ in range(epochs):
            for x, y in loader:
                opt.zero_grad()
                with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
                    pred = model(x)
                    loss = loss_fn(pred, y)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                if pred.shape == y.shape and pred.dim() == 4:
                    metric.update(pred.detach().float().clamp(0, 1), y)

    if out_dir is None:
        loop(crit)
        return [p.detach().clone() for p in model.parameters()]
    try:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, factory=factory) as rec:
            loop(rec.loss_fn)
    except NonFiniteError as e:
        return e
    return [p.detach().clone() for p in model.parameters()]


def _report(err, step, phase):
    assert isinstance(err, NonFiniteError), "the planted failure raised no event"
    assert (err.event["step"], err.event["phase"]) == (step, phase), err.event
    rep = nanreplay_json(err.bundle_path)
    return rep, rep["origin"]


def test_ms_ssim_of_a_tanh_output_without_normalize_is_a_negative_base_to_a_fractional_power(
        out_dir):
    """A tanh-output net (images in [-1, 1]) trained with L1 + (1 - MS-SSIM), the paper's
    formula (``normalize=None``): the last scale's similarity of a dark output against a [0, 1]
    target is negative, and ``sim ** beta`` is NaN in every image of the batch. The hint said
    only to clamp the base at 0; it now names the output's negative range beside the target's
    [0, 1] and says to map the output into it."""
    lq, gt = M.noisy_patches(8, size=32)
    err = _train(M.make_tanh_restorer(), M.MixLoss(normalize=None), _loader(lq, gt),
                 out_dir=out_dir, factory="metric_losses_models:make_tanh_restorer")
    rep, o = _report(err, 0, "loss")
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("<loss>", "aten.pow", [0, 1, 2, 3], "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == source_line(MODELS, "ms = multiscale_structural_similarity_index_measure(")
    assert "negative number to a fractional power" in rep["hint"], rep["hint"]
    assert "the model's output spans [-0.308, 0.05] while loss_args[1]" in rep["hint"], rep["hint"]
    assert "spans [0.1, 0.9], never below 0" in rep["hint"], rep["hint"]
    assert "(y + 1) / 2 of a tanh" in rep["hint"], rep["hint"]


def test_the_same_ms_ssim_through_a_torchmetrics_metric_object_in_the_loss_replays_alike(
        out_dir):
    """The mix through torchmetrics' ``MultiScaleStructuralSimilarityIndexMeasure`` object (a
    module with states the loss updates at each call): the replay rebuilds and re-runs it and
    names the same pow, samples and ranges."""
    lq, gt = M.noisy_patches(8, size=32)
    err = _train(M.make_tanh_restorer(), M.MetricMixLoss(normalize=None), _loader(lq, gt),
                 out_dir=out_dir, factory="metric_losses_models:make_tanh_restorer")
    rep, o = _report(err, 0, "loss")
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("<loss>", "aten.pow", [0, 1, 2, 3], "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == source_line(MODELS, "ms = self.ms_ssim(pred, target)")
    assert "spans [0.1, 0.9], never below 0" in rep["hint"], rep["hint"]


def test_per_image_psnr_of_one_clean_pair_names_the_perfect_fit_of_that_sample(out_dir):
    """``-PSNR`` per image (``dim=(1, 2, 3)``) of an identity-initialised residual denoiser: the
    pair that drew no noise is reproduced exactly, its mse is 0 and ``log(0)`` is -inf. The
    hint named only the pole: the perfect-fit advice needed the whole batch reproduced; it
    now names the output equal to the target in sample 2."""
    lq, gt = M.noisy_patches(8, clean_at=(2,))
    err = _train(M.make_restorer(), M.PSNRLoss(), _loader(lq, gt), out_dir=out_dir,
                 factory="metric_losses_models:make_restorer")
    rep, o = _report(err, 0, "loss")
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("<loss>", "aten.log", [2], "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == source_line(MODELS, "psnr = peak_signal_noise_ratio(")
    assert "that 0 is the error of a perfect fit" in rep["hint"], rep["hint"]
    assert "in sample [2], every entry of it" in rep["hint"], rep["hint"]


def test_per_series_rmse_of_a_flat_series_is_a_backward_sqrt_at_0_not_a_masked_batch(out_dir):
    """The mean of per-series RMSEs (``mean_squared_error(squared=False)``) of a persistence-
    residual forecaster: a flat series is forecast exactly at step 0, its RMSE is 0 and
    ``sqrt``'s derivative there is inf, inf * 0 = NaN in backward only. The hint said 'one 0-d
    value for the whole batch ... no row is to blame' (the masked-batch case) while naming
    sample 1: the zero ``d`` of ``d * d`` is the model's error, no mask. It now names the
    perfect fit of that series and the RMSE's infinite slope there."""
    x, y = M.series_windows(8, flat_at=(1,))
    err = _train(M.make_forecaster(), M.RMSELoss(), _loader(x, y), out_dir=out_dir,
                 factory="metric_losses_models:make_forecaster")
    rep, o = _report(err, 0, "backward")
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("<loss>", "SqrtBackward0", [1], "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == source_line(MODELS, "per_series = [mean_squared_error(")
    assert "no row is to blame" not in rep["hint"], rep["hint"]
    assert "that 0 is the error of a perfect fit" in rep["hint"], rep["hint"]
    assert "in sample [1], every entry of it" in rep["hint"], rep["hint"]
    assert "report the RMSE as a metric, or take sqrt(mse + eps)" in rep["hint"], rep["hint"]


def test_pearson_over_a_constant_forecast_is_a_pole_of_its_max_deviation(out_dir):
    """``1 - Pearson`` per series over the horizon of a persistence forecaster at step 0: each
    forecast is constant, torchmetrics scales the variance by ``max_abs_dev ** -2`` = inf, and
    ``0 * inf`` is NaN (sample 2's constant mean rounds off its value: finite, not named).
    The hint spoke of a graph's degrees; it now says the prediction is flat in those samples
    while the data varies."""
    x, y = M.series_windows(8)
    err = _train(M.make_forecaster(), M.CorrLoss(), _loader(x, y), out_dir=out_dir,
                 factory="metric_losses_models:make_forecaster")
    rep, o = _report(err, 0, "loss")
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("<loss>", "aten.pow", [0, 1, 3], "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == source_line(MODELS, "r = pearson_corrcoef(pred.T, target.T)")
    assert "that 0 is the spread of the model's output: it is constant within each of " \
        "samples [0, 1, 3]" in rep["hint"], rep["hint"]


def test_kl_of_a_sharpened_softmax_underflowing_to_0_is_underflow(out_dir):
    """``kl_divergence(target, softmax(logits / 0.005))``: the sharpened softmax underflows
    to exact 0 in bins the smoothed target holds, and ``p / q`` is inf."""
    x, h = M.histograms(8)
    err = _train(M.make_sharp_histogram_net(), M.HistKLLoss(), _loader(x, h), out_dir=out_dir,
                 factory="metric_losses_models:make_sharp_histogram_net")
    rep, o = _report(err, 0, "loss")
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("<loss>", "aten.div", [0, 1, 2, 3], "underflow"), json.dumps(rep, indent=1)
    assert "compute in log space" in rep["hint"], rep["hint"]


def test_kl_of_a_relu_normalised_histogram_with_an_empty_bin_names_the_prediction_s_zeros(
        out_dir):
    """``kl_divergence(target, q)`` of a histogram predicted as ``relu(s) / relu(s).sum()``:
    bins at exactly 0 where the smoothed target holds mass make ``p / q`` inf. The hint said
    only 'add an eps to the denominator or skip the rows'; it now says the divisor is the
    prediction, exactly 0 under positive target mass, and to floor it or work in log space."""
    x, h = M.histograms(8)
    err = _train(M.make_rectified_histogram_net(), M.HistKLLoss(), _loader(x, h),
                 out_dir=out_dir, factory="metric_losses_models:make_rectified_histogram_net")
    rep, o = _report(err, 0, "loss")
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("<loss>", "aten.div", [0, 1, 2, 3], "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == source_line(MODELS, "return kl_divergence(target, pred)")
    assert "the model's output, never negative, is exactly 0 at 22 entries of samples " \
        "[0, 1, 2, 3] where loss_args[1]" in rep["hint"], rep["hint"]
    assert "kl_divergence(..., log_prob=True)" in rep["hint"], rep["hint"]


def test_total_variation_of_an_8_bit_output_under_float16_autocast_overflows_its_sum(out_dir):
    """A net predicting 0-255 intensities under float16 autocast with a total-variation prior:
    torchmetrics' per-image ``abs().sum([1, 2, 3])`` of its float16 output passes 65504."""
    lq, gt = M.noisy_patches(8, size=32, sigma=0.3, scale=255.0)
    err = _train(M.make_255_restorer(), M.TVRestorationLoss(), _loader(lq, gt), out_dir=out_dir,
                 factory="metric_losses_models:make_255_restorer", amp=torch.float16)
    rep, o = _report(err, 0, "loss")
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("<loss>", "aten.sum", [0, 1, 2, 3], "overflow"), json.dumps(rep, indent=1)
    assert "float16" in rep["hint"], rep["hint"]


def test_healthy_perceptual_ssim_loss_raises_nothing_and_trains_bit_identically(out_dir):
    """L1 + (1 - SSIM) (pytorch-msssim) + a perceptual feature loss, and L1 + (1 - MS-SSIM)
    with torchmetrics' default ``normalize="relu"`` (functional and as a metric object), on
    noisy and clean pairs: no event, and the same weights as the run without the recorder."""
    lq, gt = M.noisy_patches(8, size=32, clean_at=(2,))
    for crit in (M.PerceptualSSIMLoss(), M.MixLoss(), M.MetricMixLoss()):
        plain = _train(M.make_restorer(), crit, _loader(lq, gt))
        recorded = _train(M.make_restorer(), crit, _loader(lq, gt), out_dir=out_dir,
                          factory="metric_losses_models:make_restorer")
        assert not isinstance(recorded, NonFiniteError), recorded.event
        assert all(torch.equal(a, b) for a, b in zip(plain, recorded))
        assert not out_dir.exists() or not any(out_dir.iterdir())
