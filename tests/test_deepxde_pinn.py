"""End to end on physics-informed neural networks (``deepxde_pinn_models``): DeepXDE 1.15's
own training loop (``dde.Model.train`` with the optimizer ``model.compile`` built, the recorder
attached to ``model.net`` and ``model.opt``; DeepXDE evaluates its losses on the training and
test points with the net before the first update, micro-batches of step 0), and the same PINN
written by hand with ``torch.autograd.grad(create_graph=True)`` inside a loss module. Each
planted bug of the domain fires under the recorder and is replayed with the CLI; the healthy
run trains without an event, bit-identically with and without the recorder."""

from __future__ import annotations

import deepxde_pinn_models as M
import numpy as np
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

FACTORY = "deepxde_pinn_models:"


def line_of(text: str) -> str:
    return source_line("deepxde_pinn_models.py", text)


def train_dde(model, out_dir, factory: str = "make_net", iterations: int = 10) -> str:
    """``model.train`` under the recorder as a DeepXDE user attaches it; the bundle's path."""
    with pytest.raises(NonFiniteError) as e:
        with FlightRecorder(model.net, model.opt, out_dir=out_dir, factory=FACTORY + factory):
            model.train(iterations=iterations, display_every=5, verbose=0)
    return e.value.bundle_path


def train_by_hand(model, loss_fn, x, out_dir, factory: str, steps: int = 10, lr: float = 1e-3):
    """The hand-written PINN's Adam loop, the loss given the collocation points it
    differentiates by; the bundle's path."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    with pytest.raises(NonFiniteError) as e:
        with FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=out_dir,
                            factory=FACTORY + factory) as rec:
            for _ in range(steps):
                opt.zero_grad()
                rec.loss_fn(model(x), x).backward()
                opt.step()
    return e.value.bundle_path


def test_healthy_deepxde_run_has_no_event_and_trains_identically(tmp_path):
    plain = M.poisson_model()
    plain.train(iterations=12, display_every=4, verbose=0)
    recorded = M.poisson_model()
    with FlightRecorder(recorded.net, recorded.opt, out_dir=tmp_path,
                        factory=FACTORY + "make_net") as rec:
        recorded.train(iterations=12, display_every=4, verbose=0)
        assert rec.step == 12  # (DeepXDE's evaluations on its points open no step of their own)
    for (name, a), b in zip(plain.net.named_parameters(), recorded.net.parameters()):
        assert torch.equal(a, b), name
    assert np.array_equal(plain.train_state.loss_train, recorded.train_state.loss_train)
    assert not list(tmp_path.iterdir())


def test_nan_anchor_among_the_collocation_points_is_named_as_data(tmp_path):
    anchors = np.array([[0.5], [np.nan]], dtype=np.float32)
    rep = nanreplay_json(train_dde(M.poisson_model(anchors=anchors), tmp_path))
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["tensor"]) == (0, "input", "batch")
    # (DeepXDE's training points: its 2 boundary-condition points, then the anchors)
    assert o["samples"] == [3] and rep["cause"] == "input"
    assert "run's first step" in rep["hint"] and "collocation points" in rep["hint"]
    assert "style transfer" not in rep["hint"]


def test_nan_collocation_point_by_hand(tmp_path):
    path = train_by_hand(M.make_mlp(), M.PoissonLoss(), M.poisson_points(nan_row=5), tmp_path,
                         "make_mlp")
    rep = nanreplay_json(path)
    assert (rep["event"]["step"], rep["origin"]["phase"], rep["origin"]["samples"]) == \
        (0, "input", [5])
    assert rep["cause"] == "input" and "collocation points" in rep["hint"]


def test_log_of_the_output_in_deepxde_pde(tmp_path):
    """log(u) of a net whose output is negative at some points: DeepXDE computes the loss
    itself, so only the gradient entering the output is seen; its rows are the points whose
    residual enters the loss (rows 0 and 1 are the boundary term's copies) with u < 0."""
    model = M.poisson_model(M.poisson_log_pde)
    with torch.no_grad():
        u = model.net(torch.as_tensor(model.data.train_x)).squeeze(1)
    negative = [i for i in (u < 0).nonzero()[:, 0].tolist() if i >= 2]
    rep = nanreplay_json(train_dde(model, tmp_path))
    o = rep["origin"]
    assert (rep["event"]["step"], rep["event"]["phase"], o["phase"]) == (0, "backward", "loss")
    assert o["samples"] == negative == [3, 12, 13, 14, 15, 16, 17, 18, 19]
    assert o["micro_batch"] == 2  # (after DeepXDE's two evaluations before training)
    assert rep["cause"] is None and "loss_fn" in rep["hint"]  # (the loss is not re-run)
    assert "only at samples where the model's output is at most 0 (9 of the 10 samples" \
        in rep["hint"] and "softplus or exp" in rep["hint"]


def test_nan_target_rows_of_both_signs_are_no_log_of_the_output(tmp_path):
    """A NaN entering at rows where the output has both signs (the rows' own NaN target in a
    data term the loop computes) is no log of the output: the sentence stays out; so it does
    at two rows whose output is <= 0 of the nine such (a log of the output makes most of them
    NaN; it said "most likely a log" of two NaN targets)."""
    def hint_for(rows, out_dir):
        model, x = M.make_net(), M.poisson_points()  # (output <= 0 at rows 8-15 and 17)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        target = torch.zeros(x.shape[0], 1)
        target[rows] = float("nan")
        with pytest.raises(NonFiniteError) as e:
            with FlightRecorder(model, opt, out_dir=out_dir, factory=FACTORY + "make_net"):
                opt.zero_grad()
                (model(x) - target).pow(2).mean().backward()  # (in the loop: not re-run)
                opt.step()
        rep = nanreplay_json(e.value.bundle_path)
        assert rep["origin"]["samples"] == rows
        return rep["hint"]

    assert "at most 0" not in hint_for([0, 9], tmp_path / "a")
    assert "at most 0" not in hint_for([9, 17], tmp_path / "b")


def test_exploding_loss_weight_overflows_adams_state(tmp_path):
    bundle = train_dde(M.heat_model(loss_weights=[1, 1, 1e38]), tmp_path, "make_heat_net")
    rep = nanreplay_json(bundle, code=1)
    assert (rep["event"]["step"], rep["origin"]["phase"], rep["cause"]) == \
        (0, "optimizer", "overflow")
    assert rep["origin"]["param"] == "linears.0.weight"
    assert "exp_avg_sq" in rep["hint"] and "loss weight" in rep["hint"]


def test_relu_net_second_derivative_divides(tmp_path):
    path = train_by_hand(M.make_relu_mlp(), M.PoissonLoss(normalise=True),
                         M.poisson_points(), tmp_path, "make_relu_mlp")
    rep = nanreplay_json(path)
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["module"], o["op"]) == \
        (0, "loss", "<loss>", "aten.div")
    assert o["source"] == line_of("res = res * u_xx.abs() / u_xx.abs().mean()")
    assert rep["cause"] == "invalid"
    assert "piecewise-linear activations (relu)" in rep["hint"]
    assert "smooth activation" in rep["hint"] and "count.clamp_min" not in rep["hint"]


def test_tanh_net_normalised_residual_is_finite():
    """The same normalised loss with tanh: finite (the relu hint's counterfactual holds)."""
    x = M.poisson_points()
    assert torch.isfinite(M.PoissonLoss(normalise=True)(M.make_mlp()(x), x))


def test_masked_sqrt_of_negative_output_is_backward_only(tmp_path):
    path = train_by_hand(M.make_mlp(), M.PorousLoss(), M.poisson_points(), tmp_path,
                         "make_mlp", lr=1e-2)
    rep = nanreplay_json(path)
    o = rep["origin"]
    assert (rep["event"]["step"], rep["event"]["phase"]) == (2, "backward")
    assert (o["module"], o["op"], o["samples"]) == ("<loss>", "SqrtBackward0", [0, 16])
    assert o["source"] == line_of("d = torch.where(u > 0, torch.sqrt(u), torch.zeros_like(u))")
    assert rep["cause"] == "invalid" and "torch.where(mask, x, 1)" in rep["hint"]
    assert "second derivative" not in rep["hint"]


def test_lbfgs_without_line_search_overflows(tmp_path):
    model, x = M.make_mlp(), M.poisson_points()
    opt = torch.optim.LBFGS(model.parameters(), lr=1e6, max_iter=5)
    with pytest.raises(NonFiniteError) as e:
        with FlightRecorder(model, opt, loss_fn=M.PoissonLoss(), out_dir=tmp_path,
                            factory=FACTORY + "make_mlp") as rec:
            for _ in range(4):
                M.lbfgs_step(model, opt, rec.loss_fn, x)
    rep = nanreplay_json(e.value.bundle_path)
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["module"], o["op"]) == \
        (4, "loss", "<loss>", "aten.pow")
    assert o["samples"] == [16, 17] and o["source"] == line_of("bc = (u[-2:] ** 2).mean()")
    assert rep["cause"] == "overflow" and 'line_search_fn="strong_wolfe"' in rep["hint"]
