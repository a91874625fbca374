"""End to end on SAR image despeckling written as SAR-CNN / ID-CNN code writes it
(``sar_despeckling_models``): intensity images with multiplicative Gamma speckle, a validity
mask of the swath's no-data border passed into ``forward``, per-image percentile
normalisation, the log-intensity network (``log(I + eps)``) and the ratio network (``I /
n_hat`` from a ReLU head), and the log-domain MSE, Gamma NLL (``lgamma(L)``) and total
variation (``sqrt(dx^2 + dy^2)``) losses. Trained with a DataLoader, Adam, gradient clipping
(and float16 autocast). Each planted bug fires under the recorder and is replayed with the
CLI; the healthy run raises no event and trains bit-identically with and without it."""

from __future__ import annotations

import contextlib

import pytest
import sar_despeckling_models as M
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

EPS_ZERO = "the eps added to that input is exactly 0"


def line_of(text: str) -> str:
    return source_line("sar_despeckling_models.py", text)


def train(make: str, crit, out_dir, record: bool = True, amp: bool = False, **plant):
    """Four steps of 8 scenes (the planted scene 29 is row 5 of the last step)."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(M.scenes(**plant), batch_size=8)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"sar_despeckling_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for noisy, valid, clean in loader:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
                out = model(noisy, valid)
            ref = noisy if isinstance(crit, M.GammaNLL) else clean
            loss = loss_fn(out.float(), ref, valid)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    return model


def fire(make: str, crit, tmp_path, **plant):
    with pytest.raises(NonFiniteError) as info:
        train(make, crit, tmp_path, **plant)
    return info.value.event, info.value.bundle_path


def test_log_of_the_no_data_border_without_eps_names_the_log(tmp_path):
    """SAR-CNN's ``log(I + eps)`` with eps 0: the swath-edge scene's no-data columns are 0,
    log(0) = -inf in that scene only. The replay names the log, scene 5, and the eps of 0."""
    ev, bundle = fire("make_log_no_eps", M.LogMSE(), tmp_path, nodata=29)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (3, "forward", "", [5]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "", "aten.log", "-inf", [5]), o
    assert o["source"] == line_of("z = torch.log(x + self.eps)"), o
    h = rep["hint"]
    assert rep["cause"] == "invalid" and "pole at 0" in h and EPS_ZERO in h, h


def test_nan_no_data_pixels_are_an_input_event_on_that_scene(tmp_path):
    """A GeoTIFF whose no-data value is NaN: an input event on scene 5 before the model."""
    ev, bundle = fire("make_log", M.LogMSE(), tmp_path, nan_at=29)
    assert (ev["step"], ev["phase"], ev["samples"]) == (3, "input", [5]), ev
    rep = nanreplay_json(bundle)
    assert (rep["origin"]["phase"], rep["origin"]["samples"], rep["cause"]) == (
        "input", [5], "input"), rep
    assert "the batch itself holds NaN/Inf" in rep["hint"], rep["hint"]


def test_ratio_by_a_dead_relu_speckle_estimate_names_the_relu(tmp_path):
    """ID-CNN's ``I / n_hat`` whose ReLU head starts dead (bias -5): n_hat is 0 everywhere,
    +inf in every scene at step 0; the hint names the ReLU that made the divisor 0."""
    ev, bundle = fire("make_ratio_dead", M.LogMSE(), tmp_path)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (
        0, "forward", "", list(range(8))), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "", "aten.div", "+inf", list(range(8))), o
    assert o["source"] == line_of("ratio = x / n_hat"), o
    h = rep["hint"]
    assert rep["cause"] == "invalid" and "a ReLU or clamp(min=0) made exactly 0" in h, h


def test_gamma_nll_with_zero_looks_names_the_setting_not_a_mask(tmp_path):
    """The Gamma NLL with a number of looks of 0 (an ENL estimate rounded down): lgamma(0) is
    +inf and ``L * log(L)`` is 0 * -inf = NaN. No mask is involved: the hint names the loss's
    attribute ``looks`` of 0 as the setting out of the formula's domain."""
    ev, bundle = fire("make_log", M.GammaNLL(looks=0), tmp_path)
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "loss", "<loss>"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"]) == ("<loss>", "aten.lgamma", "+inf"), o
    assert o["source"] == line_of("+ torch.lgamma(L) - L * torch.log(L))"), o
    h = rep["hint"]
    assert rep["cause"] == "invalid" and "mask" not in h, h
    assert "the loss's attribute looks is 0 as the step closed" in h, h


def test_total_variation_sqrt_at_the_flat_no_data_border_is_a_backward_sqrt(tmp_path):
    """TV written as ``sqrt(dx^2 + dy^2 + eps)`` with eps 0: the masked no-data border is
    flat, sqrt's gradient at 0 is inf and NaN in backward, on scene 5 at step 3."""
    ev, bundle = fire("make_log", M.TVLoss(eps=0.0), tmp_path, nodata=29)
    assert (ev["step"], ev["phase"]) == (3, "backward"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"]) == (
        "backward", "<loss>", "SqrtBackward0", [5]), o
    assert o["source"] == line_of("tv = torch.sqrt(dx ** 2 + dy ** 2 + self.eps).mean()"), o
    h = rep["hint"]
    assert rep["cause"] == "invalid" and EPS_ZERO in h, h


def test_raw_linear_units_under_float16_autocast_overflow_the_first_conv(tmp_path):
    """One scene left in raw linear units (x 1e6) with the percentile normalisation off,
    under float16 autocast: the first conv casts it to float16, +inf on scene 5, out of
    scale."""
    ev, bundle = fire("make_ratio_raw", M.LogMSE(), tmp_path, amp=True, raw=29)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (
        3, "forward", "body.net.0", [5]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "body.net.0", "aten._to_copy", "+inf", [5]), o
    h = rep["hint"]
    assert rep["cause"] == "overflow" and "float16's largest value" in h, h
    assert "out of scale" in h and "--try drop=5" in h, h


@pytest.mark.parametrize("make, crit", [("make_log", M.LogMSE), ("make_ratio", M.GammaNLL)])
def test_healthy_run_raises_nothing_and_trains_the_same(tmp_path, make, crit):
    """Both networks with their eps's, Gamma NLL of 4 looks, clean scenes with a no-data
    border: no event, bit-identical weights with and without the recorder."""
    recorded = train(make, crit(), tmp_path, nodata=29)
    plain = train(make, crit(), tmp_path, record=False, nodata=29)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name
