"""End to end on machine learning for electric power systems (``power_systems_models``): a
physics-informed GNN state estimator / OPF proxy on a 6-bus grid, with loads standardised by
the training set's statistics, a per-sample admittance matrix ``Y = A^T diag(1 / (r + jx)) A``
from each operating point's branch data, injections ``S = V conj(Y V)``, line flows
``sqrt(P^2 + Q^2)`` and a loss mixing an MSE on the voltages, the power-flow residual, a ReLU
penalty on the flows over their rating and a log-barrier on the ratings; trained with Adam, a
cosine schedule and gradient clipping on a DataLoader of operating points. Each planted
failure of the domain fires under the recorder and is replayed with the CLI; the healthy run
raises no event and trains bit-identically."""

from __future__ import annotations

import contextlib

import power_systems_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("power_systems_models.py", text)


def train(make: str, out_dir, fault: str = "", bad: int = 3, steps: int = 4,
          loss: str = "OPFLoss", record: bool = True, transit: int | None = None,
          amp: bool = False):
    """Adam, a cosine schedule and clip_grad_norm_ over a DataLoader of operating points; the
    fault is planted in sample ``bad`` of the last step's batch (``amp``: float16 autocast of
    the forward). Returns the model."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    crit = getattr(M, loss)()
    loader = torch.utils.data.DataLoader(M.OperatingPoints(8 * steps, seed=1, transit=transit),
                                         batch_size=8)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"power_systems_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for step, (args, targets) in enumerate(loader):
            if fault and step == steps - 1:
                args, targets = M.plant(args, targets, fault, bad)
            with torch.autocast("cpu", dtype=torch.float16) if amp else contextlib.nullcontext():
                out = model(*args)
            loss_value = loss_fn(out, *targets)
            opt.zero_grad()
            loss_value.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
    return model


def fire(make: str, tmp_path, fault: str = "", **kw):
    with pytest.raises(NonFiniteError) as info:
        train(make, tmp_path, fault, **kw)
    return info.value.event, info.value.bundle_path


def test_nan_scada_reading_flagged_good_is_an_input_event_on_its_operating_point(tmp_path):
    """An RTU sent a NaN load with a good quality flag: the imputation keeps it, and the
    recorder stops at the batch, naming operating point 3."""
    ev, bundle = fire("make_gnn", tmp_path, "nan_reading")
    assert (ev["step"], ev["phase"], ev["kind"], ev["samples"]) == (3, "input", "nan", [3]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["phase"], o["samples"]) == (
        True, "input", "input", [3]), rep
    assert "the batch itself holds NaN" in rep["hint"], rep["hint"]


def test_zero_impedance_branch_names_the_admittance_and_the_record_not_an_eps(tmp_path):
    """A switching action closes a bus coupler, written as a branch with r = x = 0: the series
    admittance ``status / (r + jx)`` is a complex 1/0 in operating point 3. The divisor is a
    complex number made of the batch's own r and x (was: "add an eps to the denominator",
    which makes a huge admittance the power flow trains on)."""
    ev, bundle = fire("make_gnn", tmp_path, "bus_tie")
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"], ev["samples"]) == (
        3, "forward", "", "nan", [3]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == (
        "", "aten.div", "nan", [3], "invalid"), rep
    assert o["source"] == line_of("y = status / torch.complex(r, x)"), o
    assert "the batch's own data (args[2]" in rep["hint"], rep["hint"]
    assert "here a complex number made of it and other data" in rep["hint"], rep["hint"]
    assert "zero-impedance branch" in rep["hint"] and "add an eps" not in rep["hint"]


def test_zero_injection_bus_names_the_load_std_buffer_for_every_sample(tmp_path):
    """A transit substation draws no load, so the training set's std of its load is 0: every
    operating point's standardisation is 0/0 there at the first step, and stays NaN where
    the reading is observed (a missing one is imputed after the division). The replay names
    the buffer and its entries; no record is to blame."""
    observed = M.OperatingPoints(32, seed=1, transit=3).observed[:8, 3]
    rows = torch.nonzero(observed).flatten().tolist()
    assert 0 < len(rows) < 8, rows  # (the data has a dropped reading at bus 3)
    ev, bundle = fire("make_gnn_transit", tmp_path, transit=3)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (0, "forward", "", rows), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"], rep["cause"]) == (
        "aten.div", "nan", rows, "invalid"), rep
    assert o["source"] == line_of("z = (load - self.load_mean) / self.load_std"), o
    assert "the buffer load_std" in rep["hint"] and "(3, 0), (3, 1)" in rep["hint"], rep["hint"]


def test_missing_line_rating_names_the_barrier_log_and_the_zero_bound(tmp_path):
    """The DLR feed had no rating for line 3 of operating point 3 (``fillna(0)``): the
    log-barrier's slack ``rating - |S|`` is negative whatever the model predicts. The replay
    names the loss's log on sample 3 and (new) the loss argument holding the 0 bound, not only
    the barrier's advice to start feasible."""
    ev, bundle = fire("make_gnn", tmp_path, "no_rating", loss="make_barrier_loss")
    assert (ev["step"], ev["phase"], ev["module"]) == (3, "loss", "<loss>"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["op"], o["made"], o["samples"], rep["cause"]) == (
        "loss", "aten.log", "nan", [3], "invalid"), rep
    assert o["source"] == line_of("torch.log(rating - flow)"), o
    assert "loss_args[5] is 0 at (3, 3) in the samples named" in rep["hint"], rep["hint"]
    assert "repair the bound" in rep["hint"], rep["hint"]


def test_outaged_line_flow_sqrt_at_zero_is_a_backward_event_in_line_flows(tmp_path):
    """An N-1 contingency: branch 5 out of service (status 0) carries no flow, and
    ``sqrt(P^2 + Q^2)`` of 0 has an infinite derivative: the forward is finite, the backward
    NaN. The replay names ``SqrtBackward0`` in ``flows`` on sample 3 and the complex
    modulus that takes a gradient of 0 there."""
    ev, bundle = fire("make_gnn", tmp_path, "outage")
    assert (ev["step"], ev["phase"], ev["kind"]) == (3, "backward", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"], rep["cause"]) == (
        "backward", "flows", "SqrtBackward0", [3], "invalid"), rep
    assert o["source"] == line_of("torch.sqrt(s.real ** 2 + s.imag ** 2)"), o
    assert "torch.complex(re, im).abs()" in rep["hint"], rep["hint"]


def test_kilowatt_feeder_under_float16_autocast_overflows_the_cast_into_inp(tmp_path):
    """A feeder's RTU reports kW, not p.u.: its standardised load is about 2e5, past float16's
    largest value where autocast casts it for ``inp``. The replay names the cast, sample 3,
    an overflow of data out of scale."""
    ev, bundle = fire("make_gnn", tmp_path, "kilowatt", amp=True)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (
        3, "forward", "inp", [3]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == (
        "inp", "aten._to_copy", "+inf", [3], "overflow"), rep
    assert "sample(s) 3 of args[0]" in rep["hint"] and "out of scale" in rep["hint"]


def test_float16_adam_eps_underflow_names_eps_and_small_gradients_not_absent_rows(tmp_path):
    """Pure float16 training: Adam's eps=1e-8 is 0 in float16 and (1 - beta2) g^2 of a small
    gradient underflows, so m / (sqrt(v) + eps) divides by 0 at the first update. The hint
    names the eps and says the broken rows had gradients too small to square (was: "a row
    whose gradient was all 0 (absent from the batch)", of a Linear's every row)."""
    ev, bundle = fire("make_gnn_half", tmp_path)
    assert (ev["step"], ev["phase"]) == (0, "optimizer"), ev
    rep = nanreplay_json(bundle, code=None)
    assert rep["cause"] == "optimizer", rep
    hint = rep["hint"]
    assert "eps=1e-08 is 0 in float16" in hint and "of inp.weight non-finite" in hint, hint
    assert "too small to square in float16" in hint and "absent from the batch)" not in hint


def test_healthy_run_raises_nothing_and_trains_the_same(tmp_path):
    """No event, and bit-identical weights with and without the recorder."""
    recorded = train("make_gnn", tmp_path, steps=3)
    plain = train("make_gnn", tmp_path, steps=3, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_unrecorded_outage_turns_the_weights_nan(tmp_path):
    """Without the recorder the contingency's step leaves the trained weights NaN: the
    backward event above is the bug, not a false alarm."""
    model = train("make_gnn", tmp_path, "outage", record=False)
    assert not all(torch.isfinite(p).all() for p in model.parameters())
