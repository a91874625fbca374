"""End to end on rainfall-runoff models (``hydrology_models``): Kratzert's EA-LSTM trained
sequence-to-one under the basin-averaged NSE* loss, MSE of log discharge and a masked MSE over
gauge gaps, a differentiable bucket model Euler-stepped day by day with
``ET = PET (S / Smax)^beta`` and PET ``c exp(a (T - 20))``, and an LSTM with attention pooling
over the recorded days (-inf before a record starts) forecasting several horizons from a
DataLoader under bf16 autocast with gradient accumulation. Each planted failure of the domain
fires under the recorder and is replayed with the CLI; the healthy versions raise no event and
train bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import hydrology_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("hydrology_models.py", text)


def batch(kind: str, g: torch.Generator, bad: dict):
    """(model args, loss args after the prediction) of one step."""
    if kind == "bucket":
        x_d, x_s, q = M.bucket_batch(g, **bad)
        return (x_d, x_s), (q,)
    x_d, x_s, q, q_std = M.basin_batch(g, **bad)
    if kind == "std":  # (each basin's mean discharge: 0 for the zero-flow basin too)
        return (x_d, x_s), (q, 2 * q_std, q_std)
    return (x_d, x_s), ((q, q_std) if kind == "nse" else (q,))


def train(kind: str, make: str, crit, out_dir, bad: dict | None = None, steps: int = 4,
          record: bool = True):
    """Adam with a step schedule and gradient clipping, as neuralhydrology trains; the data
    condition ``bad`` (keywords of the batch maker) is planted in the last step's batch."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(1)  # (the head's dropout)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"hydrology_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for step in range(steps):
            args, targets = batch(kind, g, bad if bad and step == steps - 1 else {})
            loss = loss_fn(model(*args), *targets)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
    return model


def fire(kind: str, make: str, crit, tmp_path, **bad):
    with pytest.raises(NonFiniteError) as info:
        train(kind, make, crit, tmp_path, bad)
    return info.value.event, info.value.bundle_path


def test_window_with_no_gauge_reading_names_the_masked_means_division_not_the_targets(tmp_path):
    """A window where no basin's gauge reported: every target is NaN, the masked MSE's mask
    keeps none, and ``sum / mask.sum()`` is 0/0. The recorder sees a NaN target beside the NaN
    loss and names the target; the replay re-runs the loss, which drops the NaN and makes its
    own: the division on its line, 0/0 of an all-masked count, no row to blame, and a floored
    count or skipping such windows as the fix."""
    ev, bundle = fire("mse", "make_ealstm", M.masked_mse, tmp_path, all_gaps=True)
    assert (ev["step"], ev["phase"], ev["tensor"]) == (3, "input", "loss_args[1]"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["phase"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "loss", "<loss>", "aten.div", "nan", []), o
    assert o["source"] == line_of("return ((y_hat[mask] - y[mask]) ** 2).sum() / mask.sum()")
    assert rep["cause"] == "invalid", rep["cause"]
    assert "every element masked" in rep["hint"] and "clamp_min(1)" in rep["hint"], rep["hint"]
    assert any("drops that NaN" in p for p in rep["problems"]), rep["problems"]


def test_nse_over_a_window_with_no_gauge_reading_names_the_empty_mean(tmp_path):
    """The same window under NSE*, whose ``scaled.mean()`` of the empty selection is 0/0."""
    ev, bundle = fire("nse", "make_ealstm", M.NSELoss(), tmp_path, all_gaps=True)
    assert (ev["phase"], ev["tensor"]) == ("input", "loss_args[1]"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"]) == (True, "<loss>", "aten.mean"), o
    assert o["source"] == line_of("return scaled.mean()"), o
    assert rep["cause"] == "invalid" and "empty selection" in rep["hint"], rep["hint"]


def test_ephemeral_stream_under_nse_with_eps_zero_names_the_weight_and_the_eps(tmp_path):
    """An ephemeral stream recorded as 0 every day of the training period: its discharge std
    is 0, and NSE* with ``eps = 0`` weights it by ``1 / 0``. The replay names the reciprocal on
    the weights' line, basin 5, the eps of exactly 0, and both the target and the std as 0 in
    that basin alone: the eps is the fix for a true zero flow, filtering for a blank record
    (it named only the target, the first such tensor, and called an eps a way to hide it)."""
    ev, bundle = fire("nse", "make_ealstm", M.NSELoss(eps=0.0), tmp_path, zero_flow=5)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (3, "loss", "<loss>", "+inf")
    rep = nanreplay_json(bundle, "--try", "drop=5")
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]
    o = rep["origin"]
    assert (rep["reproduced"], o["op"], o["made"], o["samples"]) == (
        True, "aten.reciprocal", "+inf", [5]), o
    assert o["source"] == line_of("weights = 1 / (q_std + self.eps) ** 2"), o
    hint = rep["hint"]
    assert rep["cause"] == "invalid" and "exactly 0" in hint, hint
    assert "loss_args[1] and loss_args[2] are 0 everywhere in sample(s) 5" in hint, hint
    assert "a stream with no flow" in hint and "the eps is the fix" in hint, hint
    assert "would only hide" not in hint, hint


def test_zero_flow_standardised_by_its_zero_std_names_the_division_and_the_basin(tmp_path):
    """MSE on discharge standardised per basin, ``(q - mean) / std``: the ephemeral stream's
    0 / 0. The replay names the division, basin 5, and the record (its discharge, mean and std
    all 0) to drop or repair, not an eps toward a made-up target."""
    ev, bundle = fire("std", "make_ealstm", M.standardised_mse, tmp_path, zero_flow=5)
    assert (ev["step"], ev["phase"], ev["kind"]) == (3, "loss", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"]) == ("aten.div", "nan", [5]), o
    assert o["source"] == line_of("return ((y_hat - (y - q_mean) / q_std) ** 2).mean()"), o
    assert rep["cause"] == "invalid" and "drop or repair such records" in rep["hint"]
    assert "loss_args[1] and loss_args[2] and loss_args[3] are 0 everywhere" in rep["hint"]


def test_log_of_zero_flow_with_offset_zero_names_the_log_and_its_basin(tmp_path):
    """``log(q + c)`` of a zero-flow basin with ``c = 0``: -inf on basin 2, the offset of
    exactly 0 named, and the offset as the fix for a true zero flow."""
    ev, bundle = fire("log", "make_ealstm", M.LogQLoss(c=0.0), tmp_path, zero_flow=2)
    assert (ev["step"], ev["phase"]) == (3, "loss"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"]) == ("aten.log", "-inf", [2]), o
    assert o["source"] == line_of("return ((y_hat - torch.log(q + self.c)) ** 2).mean()"), o
    hint = rep["hint"]
    assert rep["cause"] == "invalid" and "exactly 0" in hint, hint
    assert "loss_args[1] is 0 everywhere in sample(s) 2" in hint, hint
    assert "the eps is the fix" in hint and "would only hide" not in hint, hint


def test_nanmean_over_gauge_gaps_names_the_backward_that_multiplies_the_gaps(tmp_path):
    """``nanmean((y_hat - y) ** 2)`` skips the gaps in its value, and its backward multiplies
    the NaN the square saved: the replay names that node on the loss line, the gap rows 1
    and 4, and selecting the valid rows (or filling the targets) before the op."""
    ev, bundle = fire("mse", "make_ealstm", M.nanmean_mse, tmp_path, gaps=True)
    assert (ev["step"], ev["phase"]) == (3, "backward"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"]) == ("<loss>", "PowBackward0", [1, 4]), o
    assert o["source"] == line_of("return torch.nanmean((y_hat - y) ** 2)"), o
    assert rep["cause"] == "input" and "pred[mask], y[mask]" in rep["hint"], rep["hint"]


def test_unrecorded_nanmean_over_gauge_gaps_goes_nan_silently(tmp_path):
    """Without the recorder the same run's weights turn NaN while every loss it printed was
    finite: the event above is the bug, not a false alarm."""
    model = train("mse", "make_ealstm", M.nanmean_mse, tmp_path, {"gaps": True}, record=False)
    assert not all(torch.isfinite(p).all() for p in model.parameters())


def test_nanmean_over_a_window_with_no_gauge_reading_names_its_division(tmp_path):
    """``nanmean`` over a window with no reading is 0/0 (its count of non-NaN values)."""
    ev, bundle = fire("mse", "make_ealstm", M.nanmean_mse, tmp_path, all_gaps=True)
    assert (ev["phase"], ev["tensor"]) == ("input", "loss_args[1]"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["phase"], o["op"]) == (True, "loss", "aten.div"), o
    assert o["source"] == line_of("return torch.nanmean((y_hat - y) ** 2)"), o
    assert rep["cause"] == "invalid" and "every element masked" in rep["hint"], rep["hint"]


@pytest.mark.parametrize("kind,crit", [("log", M.LogQLoss()), ("nse", M.NSELoss())],
                         ids=["log", "nse"])
def test_zero_flow_with_the_default_eps_raises_nothing_and_trains_the_same(tmp_path, kind,
                                                                           crit):
    """``log(q + 0.01)`` and NSE* with eps 0.1 on the same zero-flow basin: no event,
    bit-identical weights."""
    recorded = train(kind, "make_ealstm", crit, tmp_path, {"zero_flow": 2})
    plain = train(kind, "make_ealstm", crit, tmp_path, {"zero_flow": 2}, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("crit", [M.masked_mse, M.NSELoss()], ids=["mse", "nse"])
def test_gauge_gaps_masked_in_the_loss_raise_nothing_and_train_the_same(tmp_path, crit):
    """Two missing readings per window, masked inside the loss: no event, and the weights are
    bit-identical with and without the recorder."""
    kind = "nse" if isinstance(crit, M.NSELoss) else "mse"
    recorded = train(kind, "make_ealstm", crit, tmp_path, {"gaps": True})
    plain = train(kind, "make_ealstm", crit, tmp_path, {"gaps": True}, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_guarded_masked_mse_over_a_window_with_no_reading_raises_nothing(tmp_path):
    """``torch.where`` over the gaps and a count floored at 1: the empty window's loss is 0."""
    train("mse", "make_ealstm", M.where_masked_mse, tmp_path, {"all_gaps": True})
    assert not list(tmp_path.glob("*.nan"))


def test_missing_soil_property_in_static_attributes_names_the_basin(tmp_path):
    """A NaN static attribute reaches the embedding: an input event on ``x_s``, basin 6."""
    ev, bundle = fire("mse", "make_ealstm", M.masked_mse, tmp_path, nan_static=6)
    assert (ev["step"], ev["phase"], ev["tensor"]) == (3, "input", "args[1]"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["cause"], o["tensor"], o["samples"]) == ("input", "args[1]", [6]), o
    assert "data pipeline" in rep["hint"], rep["hint"]


def test_glacier_fraction_standardised_by_a_zero_std_names_the_column_not_a_basin(tmp_path):
    """A glacier fraction 0 in every training basin, standardised by its std of 0: NaN in
    column 3 of every basin's static attributes. The replay names that column and a
    standardisation by a constant column's zero std, not a bad record."""
    ev, bundle = fire("mse", "make_ealstm", M.masked_mse, tmp_path, glacier_free=True)
    assert (ev["step"], ev["phase"], ev["tensor"]) == (3, "input", "args[1]"), ev
    rep = nanreplay_json(bundle)
    assert rep["cause"] == "input" and "column(s) 3" in rep["hint"], rep["hint"]
    assert "constant column's zero std" in rep["hint"], rep["hint"]


def test_arid_basin_drains_its_bucket_below_zero_under_a_fractional_power(tmp_path):
    """An arid basin (no rain, hot days): with a fractional beta, ``PET (S / Smax)^beta``
    exceeds a nearly empty store, the explicit Euler step leaves S below 0, and the next day's
    power is NaN. The replay names the power on its line, the day (a later run of the line),
    basin 3, and keeping the base at or above 0, by an eps for this fractional beta (it said
    ``clamp_min(0)`` alone, which leads to the backward pole of the next test)."""
    ev, bundle = fire("bucket", "make_bucket", torch.nn.MSELoss(), tmp_path, dry=3)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (3, "forward", "", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("", "aten.pow", "nan", [3]), o
    assert o["source"] == line_of("et = pet * (s / smax) ** beta"), o
    assert o["line_run"] == 5, o  # day 4 of the window (counted from 0): S < 0 after day 3
    assert rep["cause"] == "invalid" and "clamp_min(0)" in rep["hint"], rep["hint"]
    # (clamped at 0, the store's power has an infinite slope there: the test below)
    assert "an eps for a p below 1 trained through" in rep["hint"], rep["hint"]


def test_temperatures_in_kelvin_overflow_the_pet_exponential_and_name_the_basin(tmp_path):
    """One basin's temperature file is in Kelvin: ``exp(a (T - 20))`` overflows float32. The
    replay names the exp, basin 6, overflow, and that basin's data out of scale (a wrong
    unit), not a wider type."""
    ev, bundle = fire("bucket", "make_bucket", torch.nn.MSELoss(), tmp_path, kelvin=6)
    assert (ev["step"], ev["phase"], ev["module"]) == (3, "forward", ""), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"]) == ("aten.exp", "+inf", [6]), o
    assert o["source"] == line_of("pet = self.pet_c * torch.exp(self.pet_a * (temp - 20))")
    assert rep["cause"] == "overflow" and "out of scale" in rep["hint"], rep["hint"]
    assert "a wrong unit" in rep["hint"], rep["hint"]


def test_kelvin_overflow_taken_back_by_the_et_limit_names_the_exp_at_the_backward(tmp_path):
    """The same Kelvin file where ET is limited to the store, ``min(ET, S)``: the forward
    stays finite, and the product's backward multiplies the saved +inf PET by 0. The replay
    names that node, traces it to the exp on the PET line, basin 6, and the unit."""
    ev, bundle = fire("bucket", "make_bucket_limited", torch.nn.MSELoss(), tmp_path, kelvin=6)
    assert (ev["step"], ev["phase"], ev["kind"]) == (3, "backward", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["op"], o["samples"]) == (True, "MulBackward0", [6]), o
    assert o["source"] == line_of("et = pet * (s / smax) ** beta"), o
    assert "made by aten.exp at " + line_of("torch.exp(self.pet_a") in rep["hint"], rep["hint"]
    assert rep["cause"] == "overflow" and "a wrong unit" in rep["hint"], rep["hint"]


def test_bucket_clamped_at_zero_names_the_powers_infinite_derivative(tmp_path):
    """The usual first fix, the store clamped at 0: the forward stays finite, and on the arid
    basin's empty store the power's derivative ``beta S^(beta - 1)`` is infinite (beta < 1).
    The replay names the power's backward node on that line, basin 3, and an eps."""
    ev, bundle = fire("bucket", "make_bucket_clamped", torch.nn.MSELoss(), tmp_path, dry=3)
    assert (ev["step"], ev["phase"]) == (3, "backward"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["phase"], o["op"], o["samples"]) == (
        True, "backward", "PowBackward1", [3]), o
    assert o["source"] == line_of("et = pet * (s / smax) ** beta"), o
    assert rep["cause"] == "invalid" and "add an eps" in rep["hint"], rep["hint"]


def test_bucket_floored_above_zero_raises_nothing_on_an_arid_basin_and_trains_the_same(
        tmp_path):
    """The store floored at 1e-6 after each step: no event, bit-identical weights."""
    crit = torch.nn.MSELoss()
    recorded = train("bucket", "make_bucket_floored", crit, tmp_path, {"dry": 3})
    plain = train("bucket", "make_bucket_floored", crit, tmp_path, {"dry": 3}, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def train_loader(out_dir, late: int | None = None, record: bool = True, accumulate: int = 2):
    """The attention LSTM over a DataLoader of basin windows, gradients accumulated over two
    batches, under bf16 autocast as on an accelerator; returns the model."""
    model = M.make_attention()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = M.BasinWindows(late=late)
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True,
                                         generator=torch.Generator().manual_seed(0))
    rec = FlightRecorder(model, opt, loss_fn=M.masked_mse, out_dir=out_dir,
                         factory="hydrology_models:make_attention") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else M.masked_mse
        for i, (x_d, x_s, recorded, q) in enumerate(loader):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y_hat = model(x_d, x_s, recorded)
            loss = loss_fn(y_hat.float(), q) / accumulate
            loss.backward()
            if (i + 1) % accumulate == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
    return model


def test_padded_days_masked_with_minus_inf_raise_nothing_and_train_the_same(tmp_path):
    """Days before each gauge's record masked with -inf in the attention pooling, gauge gaps
    masked in the loss, bf16 autocast and accumulation: no event, bit-identical weights."""
    recorded = train_loader(tmp_path)
    plain = train_loader(tmp_path, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_window_before_a_gauges_record_starts_names_the_fully_masked_softmax(tmp_path):
    """Basin 5's record starts after the window ends: every day is masked with -inf, and the
    attention softmax of that row is NaN (bf16 autocast, the first accumulated batch, the
    basin at row 7 after the shuffle). The replay names the softmax on its line, row 7, the
    fully masked row, keeping at least one key or filtering such windows, whose padded
    forcings are all 0 (a blank record)."""
    with pytest.raises(NonFiniteError) as info:
        train_loader(tmp_path, late=5)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (0, "forward", "", [7])
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], o["op"], o["made"], o["samples"]) == (
        True, "aten._softmax", "nan", [7]), o
    assert o["source"] == line_of("w = torch.softmax(scores, 1)"), o
    assert rep["cause"] == "invalid" and "fully masked row" in rep["hint"], rep["hint"]
    assert "args[0] is 0 everywhere in sample(s) 7" in rep["hint"], rep["hint"]
