"""End to end on a physics-informed battery model (``battery_modeling_models``): coulomb
counting over padded per-cell sequences, an OCV MLP squashed by a sigmoid, an Arrhenius
resistance, an RC pair by explicit Euler, a power-law capacity fade and an LSTM over packed
sequences correcting the residual, trained with Adam, a step schedule and gradient clipping
on a per-cell normalised voltage loss. Each planted data condition of the domain fires under
the recorder and is replayed with the CLI; the healthy model (whose dI/dt is 0/0 in every
padded step, dropped by the packing) raises no event and trains bit-identically."""

from __future__ import annotations

import contextlib

import battery_modeling_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("battery_modeling_models.py", text)


def train(make: str, out_dir, fault: str = "", bad: int = 3, steps: int = 4,
          loss: str = "voltage_loss_eps", record: bool = True):
    """Adam, StepLR and clip_grad_norm_ as SOC-estimation code trains; the fault is planted in
    cell ``bad`` of the last step's batch. Returns the model."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    crit = getattr(M, loss)
    g = torch.Generator().manual_seed(0)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"battery_modeling_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for step in range(steps):
            args, targets = M.cell_batch(g, bad, fault if step == steps - 1 else "")
            loss_value = loss_fn(model(*args), *targets)
            opt.zero_grad()
            loss_value.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
    return model


def fire(make: str, tmp_path, fault: str, **kw):
    with pytest.raises(NonFiniteError) as info:
        train(make, tmp_path, fault, **kw)
    return info.value.event, info.value.bundle_path


def test_celsius_record_at_zero_degrees_names_the_arrhenius_reciprocal_and_the_cell(tmp_path):
    """One cell's logger wrote degC into a column read as Kelvin, starting at 0 degC: the
    Arrhenius factor's ``1 / T`` is +inf there. The replay names the reciprocal in ``thermal``,
    cell 3 alone, and the record's 0 (repair the data, not an eps)."""
    ev, bundle = fire("make_cell", tmp_path, "celsius")
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"], ev["samples"]) == (
        3, "forward", "thermal", "+inf", [3]), ev
    rep = nanreplay_json(bundle, "--try", "drop=3")
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["samples"]) == (
        True, "thermal", "aten.reciprocal", [3]), o
    assert o["source"] == line_of("inv_t = 1.0 / temp_k"), o
    assert rep["cause"] == "invalid" and "the batch's own data" in rep["hint"], rep["hint"]
    assert "An eps on it would" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_temperature_padded_with_zero_kelvin_names_every_padded_cell(tmp_path):
    """``pad_sequence``'s default 0 in the temperature column is 0 K: every shorter cell's
    padded steps make 1/T = +inf. The replay names the cells that have padding, no other."""
    ev, bundle = fire("make_cell", tmp_path, "zero_pad")
    assert (ev["step"], ev["module"], ev["samples"]) == (3, "thermal", [1, 2, 3, 5, 6, 7]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], o["samples"], rep["cause"]) == (
        "aten.reciprocal", [1, 2, 3, 5, 6, 7], "invalid"), rep
    # (its 0s are the padding by the step mask the model is given: no record is bad)
    assert "every such entry is padding by args[6]" in rep["hint"], rep["hint"]
    assert "torch.where(mask.bool(), x, 1)" in rep["hint"], rep["hint"]


def test_missing_capacity_names_the_coulomb_count_and_the_record_not_an_eps(tmp_path):
    """A cell whose metadata had no capacity (``fillna(0)``): ``cumsum(I dt) / q`` with
    ``q = q_nom (1 - a N^z)`` is 0/0 at its first step. The divisor is the record's 0 times a
    learned fade, so the hint points at the record instead of an eps (which would count its
    charge in units of 1/eps)."""
    ev, bundle = fire("make_cell", tmp_path, "no_capacity")
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"], ev["samples"]) == (
        3, "forward", "", "nan", [3]), ev
    rep = nanreplay_json(bundle, "--try", "drop=3")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("", "aten.div", "nan", [3]), o
    assert o["source"] == line_of("torch.cumsum(current * dt, dim=1) / 3600.0 / q[:, None]"), o
    assert rep["cause"] == "invalid" and "the batch's own data" in rep["hint"], rep["hint"]
    assert "a learned factor" in rep["hint"] and "add an eps" not in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_repeated_timestamp_names_the_current_rate_and_its_cell(tmp_path):
    """A logger writing two rows in one second: ``dI/dt`` divides by dt = 0 in cell 3 (the
    padded steps' 0/0 every step is dropped by the packing and is not blamed). The divisor is
    a difference of the record's timestamps, so the hint points at the duplicated row."""
    ev, bundle = fire("make_cell", tmp_path, "repeated_time")
    assert (ev["step"], ev["module"], ev["samples"]) == (3, "", [3]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], o["samples"], rep["cause"]) == ("aten.div", [3], "invalid"), rep
    assert o["source"] == line_of("torch.diff(current, dim=1) / torch.diff(time, dim=1)"), o
    # (was: "add an eps to the denominator": a made-up rate dI / eps the LSTM trains on)
    assert "a difference of two of the batch's own values" in rep["hint"], rep["hint"]
    assert "a timestamp logged twice" in rep["hint"] and "add an eps" not in rep["hint"]


def test_full_discharge_names_the_nernst_log_at_soc_zero(tmp_path):
    """A cell starting nearly empty: coulomb counting clamps its SOC to exactly 0 and the
    Nernst term's ``log(SOC / (1 - SOC))`` is -inf. The replay names the log, cell 3, and
    clamping its input away from the pole."""
    ev, bundle = fire("make_cell_nernst", tmp_path, "empty")
    assert (ev["step"], ev["module"], ev["kind"], ev["samples"]) == (3, "", "-inf", [3]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"], rep["cause"]) == (
        "aten.log", "-inf", [3], "invalid"), rep
    assert o["source"] == line_of("torch.log(soc / (1 - soc))"), o
    assert "clamp_min(eps)" in rep["hint"], rep["hint"]


def test_resting_cell_names_the_loss_normaliser_and_no_model_input(tmp_path):
    """A cell at rest: no current and a flat voltage, so its per-cell voltage std is exactly 0
    and the normalised error is x/0. The hint says the loss's divisor is the record's, and
    does not blame the model input that is 0 in that cell too (its current, which no
    divisor of the loss reads)."""
    ev, bundle = fire("make_cell", tmp_path, "resting", loss="voltage_loss")
    assert (ev["step"], ev["phase"], ev["module"]) == (3, "loss", "<loss>"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["op"], o["samples"], rep["cause"]) == (
        "loss", "aten.div", [3], "invalid"), rep
    assert o["source"] == line_of("z = (v_pred - v_meas) / std"), o
    assert "degenerate for this loss" in rep["hint"], rep["hint"]
    assert "hold no counts" not in rep["hint"], rep["hint"]


@pytest.mark.parametrize("make", ["make_cell", "make_cell_nernst", "make_cell_fade_rate"])
def test_healthy_runs_raise_nothing_and_train_the_same(tmp_path, make):
    """No event, though ``dI/dt`` is 0/0 in every padded step (dropped by
    ``pack_padded_sequence``), and bit-identical weights with and without the recorder."""
    recorded = train(make, tmp_path, steps=3)
    plain = train(make, tmp_path, steps=3, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_fresh_cell_fade_rate_pole_saturated_by_the_lstm_names_the_pow(tmp_path):
    """A fresh cell at cycle 0: the square-root law's fade rate ``a z N^(z-1)`` is +inf (a
    pole of 0 to the power -0.5); the LSTM's gates saturate it to a finite output, and its
    weight gradient is inf * 0 = NaN: a backward event. The replay follows the +inf the LSTM
    saved to the pow that made it, in cell 3, though a 0/0 of ``dI/dt`` in the padded steps
    (dropped by the packing) was made before it; the hint asks for a safe base."""
    ev, bundle = fire("make_cell_fade_rate", tmp_path, "fresh")
    assert (ev["step"], ev["phase"]) == (3, "backward"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["samples"], rep["cause"]) == (
        "backward", "residual.lstm", [3], "invalid"), rep
    made = o["chain"][0]
    assert (made["op"], made["made"], made["source"]) == (
        "aten.pow", "+inf", line_of("cycles.pow(self.z - 1)")), o
    assert "0 to a negative power" in rep["hint"] and "clamp(min=1)" in rep["hint"], rep["hint"]


def test_unrecorded_fresh_cell_turns_the_weights_nan(tmp_path):
    """Without the recorder the fresh cell's step leaves every trained weight NaN (clipping
    scales the NaN gradient by a NaN norm): the backward event above is the bug, not a false
    alarm. (``k_nernst`` is unused without the Nernst term: no gradient.)"""
    model = train("make_cell_fade_rate", tmp_path, "fresh", record=False)
    finite = [n for n, p in model.named_parameters() if torch.isfinite(p).all()]
    assert finite == ["k_nernst"], finite


def test_celsius_record_on_a_warm_day_overflows_the_loss_and_points_at_thermal(tmp_path):
    """The Celsius logger at about 25 degC: 1/T is 12x too large, the Arrhenius factor
    e^(Ea/R (1/T - 1/T_ref)) is about 1e36 (finite), and the cell's normalised error squared
    overflows in the loss. The replay names the loss's pow on cell 3 (an overflow; dropping it
    makes the step finite) and the precursor names ``thermal``'s jump, where the value left
    its scale."""
    ev, bundle = fire("make_cell", tmp_path, "celsius_warm")
    assert (ev["step"], ev["phase"]) == (3, "loss"), ev
    rep = nanreplay_json(bundle, "--try", "drop=3")
    o = rep["origin"]
    assert (o["phase"], o["op"], o["made"], o["samples"], rep["cause"]) == (
        "loss", "aten.pow", "+inf", [3], "overflow"), rep
    assert o["source"] == line_of("return (z ** 2 * m).sum() / m.sum()"), o
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]
    jumps = [p["detail"] for p in rep["precursors"] if p["kind"] == "absmax_jump"]
    assert jumps and jumps[0].startswith("absmax of thermal jumped"), rep["precursors"]
