"""End to end: a loop that runs under ``torch.autograd.detect_anomaly()`` too. Anomaly mode
raises inside backward at a node's NaN, before any reaches a gradient the recorder reads; the
recorder still writes the bundle (event reason ``anomaly``), and the replay, which runs without
anomaly mode, says whether that NaN reached the parameters or was dropped by a later node."""

from __future__ import annotations

import json

import pytest
import scale_models as SM
import torch
from bundles import invoke_cli

from recorder import FlightRecorder
from recorder.bundle import read_bundle

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def train_under_anomaly_mode(tmp_path, clamped: bool) -> tuple[RuntimeError, dict]:
    model = SM.make_sqrt_gate(clamped)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    crit = torch.nn.MSELoss()
    g = torch.Generator().manual_seed(0)
    with pytest.raises(RuntimeError) as info, pytest.warns(UserWarning), \
            torch.autograd.detect_anomaly():
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="scale_models:make_sqrt_gate",
                            factory_kwargs={"clamped": clamped}):
            for _ in range(3):
                opt.zero_grad()
                crit(model(torch.randn(8, 4, generator=g)), torch.ones(8, 4)).backward()
                opt.step()
    assert "returned nan values" in str(info.value)
    [bundle] = list(tmp_path.glob("*.nan"))
    meta, _ = read_bundle(bundle)
    assert (meta["event"]["reason"], meta["event"]["phase"], meta["event"]["step"]) == (
        "anomaly", "backward", 0)
    r = invoke_cli(bundle, "--json")
    return info.value, json.loads(r.stdout)


def test_a_nan_a_later_node_drops_is_named_and_said_harmless(tmp_path):
    err, rep = train_under_anomaly_mode(tmp_path, clamped=True)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["params"], rep["cause"], rep["reproduced"]) == (
        "backward", "", "SqrtBackward0", [], "invalid", True), o
    assert any(p.startswith("torch.autograd's anomaly mode (set_detect_anomaly) stopped "
                            "training at this NaN, but re-run without it every parameter's "
                            "gradient is finite") for p in rep["problems"]), rep["problems"]


def test_a_nan_that_reaches_the_parameters_is_the_usual_backward_report(tmp_path):
    err, rep = train_under_anomaly_mode(tmp_path, clamped=False)
    o = rep["origin"]
    assert (o["phase"], o["op"], rep["cause"], rep["reproduced"]) == (
        "backward", "SqrtBackward0", "invalid", True), o
    assert set(o["params"]) == {"lin.weight", "lin.bias"}
    assert not any("anomaly mode" in p for p in rep["problems"])


def test_a_nan_of_a_penalty_outside_loss_fn_is_not_said_dropped(tmp_path):
    """The loop adds a penalty to the loss ``loss_fn`` returned, ``sqrt(|out * x0|)``, whose
    backward is NaN for a record with ``x0 = 0`` (abs's derivative at 0 times sqrt's infinite
    one): anomaly mode stops the step in ``AbsBackward0``. The replay re-runs the model and
    ``loss_fn``, whose backward is finite: the node is not in what it re-runs, which the note
    says (not that a later node dropped the NaN, which it did not: without anomaly mode every
    parameter's gradient is NaN), and the hint says to compute the whole loss in loss_fn."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    rec = FlightRecorder(model, opt, loss_fn=torch.nn.MSELoss(), out_dir=tmp_path)
    with pytest.raises(RuntimeError, match="Function 'AbsBackward0' returned nan"), \
            pytest.warns(UserWarning), torch.autograd.detect_anomaly(), rec:
        for step in range(4):
            x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
            x[3, 0] = 0.0 if step == 2 else x[3, 0]
            out = model(x)
            loss = rec.loss_fn(out, y) + 1e-3 * (out * x[:, :1]).abs().sqrt().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    [bundle] = list(tmp_path.glob("*.nan"))
    rep = json.loads(invoke_cli(bundle, "--json").stdout)
    assert (rep["event"]["step"], rep["reproduced"], rep["origin"]["op"]) == (2, False, None), rep
    assert any("makes no NaN: the node that made it is not in what the replay re-runs"
               in p for p in rep["problems"]), rep["problems"]
    assert not any("a later backward node drops it" in p for p in rep["problems"])
    assert rep["hint"].startswith("compute the whole loss inside loss_fn"), rep["hint"]
