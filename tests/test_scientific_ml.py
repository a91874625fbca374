"""End to end on scientific-ML training code (``sciml_models``): a PINN whose loss takes
``autograd.grad`` of the model output with respect to its input coordinates, which require
grad. The replay must feed the loss the very input tensor the re-run's forward took, and name
the model's backward node that made the NaN inside the loss."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import sciml_models as SM
import torch
from bundles import invoke_cli

from recorder import FlightRecorder, NonFiniteError

HERE = Path(__file__).parent


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def train_pinn(tmp_path, steps=6, grid_from=3, make=SM.make_model, **kw):
    model = make()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    losses = []
    with FlightRecorder(model, opt, loss_fn=SM.pde_residual_loss, out_dir=tmp_path,
                        factory=f"sciml_models:{make.__name__}", **kw) as rec:
        for step in range(steps):
            xy, xb = SM.collocation(step, g, grid_from), SM.boundary(g)
            losses.append(SM.train_step(model, opt, rec.loss_fn, xy, xb))
    return losses


def test_pinn_sqrt_at_the_origin_names_the_backward_node_inside_the_loss(tmp_path):
    """From step 3 the collocation grid holds the origin (row 24): the loss's autograd.grad
    runs SqrtBackward0 of the polar features at r = 0, whose derivative is infinite. The
    replay re-runs the loss on the re-run's own collocation points, which require grad, and
    names that node, in ``features``, on row 24; dropping the row makes the step finite."""
    with pytest.raises(NonFiniteError) as info:
        train_pinn(tmp_path)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["micro_batch"]) == (3, "loss", 0), ev
    rep = json.loads(invoke_cli(info.value.bundle_path, "--json", "--try", "drop=24").stdout)
    o = rep["origin"]
    assert (rep["reproduced"], o["phase"], o["module"], o["op"], o["samples"]) == (
        True, "loss", "features", "SqrtBackward0", [24]), rep
    assert o["source"] == "sciml_models.py:16", o
    assert rep["fidelity"]["matches"] is True, rep["fidelity"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_pinn_residual_computed_in_the_loop_names_the_node_its_derivative_runs(tmp_path):
    """The common layout: the loop computes the residual with autograd.grad and gives it to
    an nn.MSELoss against zeros. The bundle holds the residual as it was (NaN on row 24),
    not how it was made; the replay differentiates the re-run output with respect to the
    collocation points as the loop did and names SqrtBackward0 in features at its pole,
    with a note saying the term is the loop's."""
    model = SM.make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=torch.nn.MSELoss(), out_dir=tmp_path,
                            factory="sciml_models:make_model") as rec:
            for step in range(6):
                xy, xb = SM.collocation(step, g, 3), SM.boundary(g)
                opt.zero_grad()
                res = SM.residual(model(xy), xy)
                loss = rec.loss_fn(res, torch.zeros_like(res)) + model(xb).pow(2).mean()
                loss.backward()
                opt.step()
    assert (info.value.event["step"], info.value.event["phase"]) == (3, "loss")
    rep = json.loads(invoke_cli(info.value.bundle_path, "--json").stdout)
    o = rep["origin"]
    assert (o["op"], o["module"], o["samples"], o["source"], rep["cause"]) == (
        "SqrtBackward0", "features", [24], "sciml_models.py:16", "invalid"), rep
    assert any("the loop computed from the model output's derivatives" in p
               for p in rep["problems"]), rep["problems"]


def test_pinn_output_gradient_of_the_loss_own_autograd_grad_is_not_replayed(tmp_path):
    """The residual's autograd.grad(u, xy, ones, create_graph=True) runs through the output's
    node with a gradient of ones; the step's backward never does (the residual depends on u's
    derivatives, not its value). Recorded as the output's gradient, those ones were fed into
    the re-run's backward in place of the loss's: every gradient finite, in float32 and
    float64 alike, so the pole at r = 0 read as 'precision'. It is the invalid sqrt at 0."""
    with pytest.raises(NonFiniteError) as info:
        train_pinn(tmp_path)
    rep = json.loads(invoke_cli(info.value.bundle_path, "--json").stdout)
    assert (rep["origin"]["op"], rep["cause"]) == ("SqrtBackward0", "invalid"), rep
    assert "in float64 too" in rep["hint"] and "pole" in rep["hint"], rep["hint"]


def train_double_backprop(tmp_path, in_loss: bool, steps=5, pad_at=3):
    """``in_loss``: the penalty inside the loss given to the recorder, else added in the loop
    to a plain cross entropy."""
    model = SM.make_classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    crit = SM.double_backprop_loss if in_loss else torch.nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(1)
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                        factory="sciml_models:make_classifier") as rec:
        for step in range(steps):
            x, y = SM.classifier_batch(step, g, pad_at)
            opt.zero_grad()
            out = model(x)
            if in_loss:
                loss = rec.loss_fn(out, y, x)
            else:
                ce = rec.loss_fn(out, y)
                loss = ce + 0.1 * SM.input_gradient_norm(ce, x)
            loss.backward()
            opt.step()


def test_double_backprop_penalty_in_the_loss_names_sqrt_backward_on_the_padded_row(tmp_path):
    """The penalty's sqrt at the zero row's exactly-0 input gradient makes the step's backward
    NaN. The loss differentiates the model, so the weights' gradients come through the
    output's derivative too, not only through the output: the replay backpropagates the loss
    itself, not the gradient recorded at the output (which gave finite gradients: 'NOT
    reproduced')."""
    with pytest.raises(NonFiniteError) as info:
        train_double_backprop(tmp_path, in_loss=True)
    ev = info.value.event
    assert (ev["step"], ev["phase"]) == (3, "backward"), ev
    rep = json.loads(invoke_cli(info.value.bundle_path, "--json", "--try", "drop=5").stdout)
    o = rep["origin"]
    assert (rep["reproduced"], o["op"], o["module"], o["samples"], rep["cause"]) == (
        True, "SqrtBackward0", "<loss>", [5], "invalid"), rep
    assert o["source"].startswith("sciml_models.py:"), o
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_double_backprop_penalty_added_in_the_loop_is_said_not_rerun(tmp_path):
    """The same penalty added in the loop to a plain cross entropy: the replay re-runs the
    model and the loss only, so the NaN does not come back. The report says why (the loop
    differentiated the output itself, a term the bundle does not hold) and how to make it
    replayable, instead of blaming state outside the bundle or a transient fault."""
    with pytest.raises(NonFiniteError) as info:
        train_double_backprop(tmp_path, in_loss=False)
    assert (info.value.event["step"], info.value.event["phase"]) == (3, "backward")
    rep = json.loads(invoke_cli(info.value.bundle_path, "--json").stdout)
    assert (rep["reproduced"], rep["cause"]) == (False, "not_reproduced"), rep
    assert any("the loop differentiated the model's output itself (micro-batch 0" in p
               for p in rep["problems"]), rep["problems"]
    assert "inside the loss" in rep["hint"] and "transient" not in rep["hint"], rep["hint"]


def train_hnn(tmp_path, rest_at: int, record: bool = True, steps: int = 5):
    model = SM.make_hnn()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = torch.nn.MSELoss()
    g = torch.Generator().manual_seed(1)
    losses = []
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                         factory="sciml_models:make_hnn") if record else None
    with rec or contextlib.nullcontext():
        for step in range(steps):
            x, dx = SM.pendulum_batch(step, g, rest_at)
            opt.zero_grad()
            loss = crit(model(x), dx)
            loss.backward()
            opt.step()
            with torch.no_grad():  # a validation forward: its autograd.grad needs enable_grad
                losses.append((loss.item(), crit(model(x), dx).item()))
    return losses


def test_hamiltonian_network_trains_as_without_the_recorder(tmp_path):
    """A forward that calls autograd.grad itself, and no_grad validation forwards of it: no
    event, and the same losses as without the recorder."""
    assert train_hnn(tmp_path, rest_at=-1) == train_hnn(tmp_path, rest_at=-1, record=False)
    assert not list(tmp_path.glob("*.nan"))


def test_hamiltonian_network_names_the_node_its_own_autograd_grad_ran(tmp_path):
    """At step 3 a state at rest (row 7) reaches the energy's radial feature at 0: the
    forward's autograd.grad runs SqrtBackward0, whose aten.div makes +inf. The report names
    that node and the sqrt's line, and advises making sqrt's input safe, not adding an eps
    to a denominator the user never wrote."""
    with pytest.raises(NonFiniteError) as info:
        train_hnn(tmp_path, rest_at=3)
    assert (info.value.event["step"], info.value.event["phase"]) == (3, "forward")
    r = invoke_cli(info.value.bundle_path, "--json")
    rep = json.loads(r.stdout)
    o = rep["origin"]
    line = next(i for i, t in enumerate((HERE / "sciml_models.py").read_text().splitlines(), 1)
                if "the bug: its derivative at rest" in t)
    assert (o["op"], o["node"], o["node_source"], o["samples"], rep["cause"]) == (
        "aten.div", "SqrtBackward0", f"sciml_models.py:{line}", [7], "invalid"), rep
    assert "make that input safe" in rep["hint"] and "std + eps" not in rep["hint"], rep["hint"]
    text = invoke_cli(info.value.bundle_path).stdout
    assert f"aten.div of SqrtBackward0 (sciml_models.py:{line})" in text, text


def test_neural_ode_whose_rk4_steps_blow_up_says_the_iterates_diverged(tmp_path):
    """An initial state outside the data (row 5 at step 3) makes the explicit RK4 loop
    unstable: the vector field's output grows call after call until one overflows. The
    report names that call's op and adds that the iterates were diverging, which float64
    only postpones (a smaller dt, bounded dynamics), not only 'compute it in float64'."""
    model = SM.make_ode()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=torch.nn.MSELoss(), out_dir=tmp_path,
                            factory="sciml_models:make_ode") as rec:
            for step in range(5):
                y0 = SM.ode_batch(step, g, far_at=3)
                opt.zero_grad()
                rec.loss_fn(model(y0), y0[:, None].expand(-1, 21, -1)).backward()
                opt.step()
    assert (info.value.event["step"], info.value.event["phase"]) == (3, "forward")
    rep = json.loads(invoke_cli(info.value.bundle_path, "--json").stdout)
    o = rep["origin"]
    assert (o["module"], o["samples"], rep["cause"]) == ("func", [5], "overflow"), rep
    assert o["call"] >= 8, o
    assert any("func's output grew from" in p and "diverging" in p for p in rep["problems"])
    assert "a smaller dt" in rep["hint"] and "only postpones" in rep["hint"], rep["hint"]


def test_pinn_atan2_at_the_origin_names_its_derivative_op_in_the_loss(tmp_path):
    """With the radius smoothed, atan2(y, x) at the origin is what remains: no node returns a
    non-finite gradient from finite ones there, so the loss is re-run under the op finder,
    which needs the forward's graph (the replay failed: 'element 0 of tensors does not
    require grad'). It names aten.reciprocal of Atan2Backward0 and the atan2's line."""
    with pytest.raises(NonFiniteError) as info:
        train_pinn(tmp_path, make=SM.make_smoothed_model)
    assert (info.value.event["step"], info.value.event["phase"]) == (3, "loss")
    rep = json.loads(invoke_cli(info.value.bundle_path, "--json").stdout)
    o = rep["origin"]
    line = next(i for i, t in enumerate((HERE / "sciml_models.py").read_text().splitlines(), 1)
                if "its derivative (-y, x) / (x² + y²)" in t)
    assert (rep["reproduced"], o["op"], o["node"], o["node_source"], o["samples"],
            rep["cause"]) == (True, "aten.reciprocal", "Atan2Backward0",
                              f"sciml_models.py:{line}", [24], "invalid"), rep
    assert "at atan2's input" in rep["hint"], rep["hint"]
