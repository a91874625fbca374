"""End to end on Hamiltonian and Lagrangian neural networks (``lagrangian_networks_models``): an
HNN whose vector field ``torch.autograd.grad(create_graph=True)`` takes inside ``forward`` (its
input made to require grad there, as HNN code does), with a port-Hamiltonian friction term and a
masked loss over a ``DataLoader`` with gradient clipping; LNNs solving for accelerations with the
Hessian of the learned Lagrangian (``torch.func`` and ``torch.linalg.solve``, or the 1-DOF closed
form); a separable HNN with a Cholesky mass matrix, a leapfrog rollout unrolled in ``forward`` and
a log-det regulariser. Each planted bug fires under the recorder and is replayed with the CLI;
the healthy run trains without an event, bit-identically with and without the recorder."""

from __future__ import annotations

import lagrangian_networks_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line
from torch import nn

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

FACTORY = "lagrangian_networks_models:"


def line_of(text: str) -> str:
    return source_line("lagrangian_networks_models.py", text)


def hnn_bundle(make, loader, out_dir) -> str:
    model = make()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with pytest.raises(NonFiniteError) as e:
        with FlightRecorder(model, opt, loss_fn=M.MaskedMSE(), out_dir=out_dir,
                            factory=FACTORY + make.__name__) as rec:
            M.fit_hnn(model, opt, rec.loss_fn, loader)
    return e.value.bundle_path


def states_bundle(make, data, out_dir, raises=NonFiniteError) -> str:
    model = make()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with pytest.raises(raises) as e:
        with FlightRecorder(model, opt, loss_fn=nn.MSELoss(), out_dir=out_dir,
                            factory=FACTORY + make.__name__) as rec:
            M.fit_states(model, opt, rec.loss_fn, *data)
    if raises is NonFiniteError:
        return e.value.bundle_path
    [bundle] = out_dir.glob("*.nan")  # (the decomposition's own error, the bundle written)
    return bundle


def rollout_bundle(make, data, out_dir, reg: float = 0.0) -> str:
    model = make()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with pytest.raises(NonFiniteError) as e:
        with FlightRecorder(model, opt, loss_fn=M.RolloutLoss(model, reg), out_dir=out_dir,
                            factory=FACTORY + make.__name__) as rec:
            M.fit_rollout(model, opt, rec.loss_fn, *data)
    return e.value.bundle_path


def test_healthy_runs_have_no_event_and_train_identically(tmp_path):
    def hnn(record: bool):
        model = M.make_coulomb_hnn()  # (no mass at rest: the friction is finite)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        if not record:
            M.fit_hnn(model, opt, M.MaskedMSE(), M.spring_loader(), epochs=2)
            return model
        with FlightRecorder(model, opt, loss_fn=M.MaskedMSE(), out_dir=tmp_path,
                            factory=FACTORY + "make_coulomb_hnn") as rec:
            M.fit_hnn(model, opt, rec.loss_fn, M.spring_loader(), epochs=2)
            assert rec.step == 8
        return model

    def shnn(record: bool):
        model = M.make_shnn()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        loss_fn, data = M.RolloutLoss(model, 0.01), M.spring_trajectories()
        if not record:
            M.fit_rollout(model, opt, loss_fn, *data)
            return model
        with FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=tmp_path,
                            factory=FACTORY + "make_shnn") as rec:
            M.fit_rollout(model, opt, rec.loss_fn, *data)
        return model

    for build in (hnn, shnn):
        for (name, a), b in zip(build(False).named_parameters(), build(True).parameters()):
            assert torch.equal(a, b), name
    model, opt = M.make_lnn2(), None
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with FlightRecorder(model, opt, loss_fn=nn.MSELoss(), out_dir=tmp_path,
                        factory=FACTORY + "make_lnn2") as rec:
        M.fit_states(model, opt, rec.loss_fn, *M.double_spring_states())
    assert not list(tmp_path.iterdir())


def test_nan_state_in_the_data_set_is_data_not_a_trained_input(tmp_path):
    """The HNN's forward makes the loader's tensor require grad itself (``x.requires_grad_``):
    the bundle holds an input that required grad, which was read as a tensor the loop trains
    (style transfer's image) and sent to an update that never was."""
    rep = nanreplay_json(hnn_bundle(M.make_hnn, M.spring_loader(nan_row=37), tmp_path))
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["samples"]) == (2, "input", [5])  # (row 37)
    assert rep["cause"] == "input" and "data pipeline" in rep["hint"]
    assert "style transfer" not in rep["hint"] and "required grad" not in rep["hint"]


def test_coulomb_friction_of_a_mass_at_rest(tmp_path):
    rep = nanreplay_json(hnn_bundle(M.make_coulomb_hnn, M.spring_loader(at_rest=(20, 27)),
                                    tmp_path))
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["module"], o["op"]) == \
        (1, "forward", "friction", "aten.div")
    assert o["samples"] == [4, 11]  # (rows 20 and 27 of the data set, in its second batch)
    assert o["source"] == line_of("return -c * p / speed")
    assert rep["cause"] == "invalid" and "0/0" in rep["hint"]


def test_relu_lagrangian_has_no_mass_matrix(tmp_path):
    """qddot = (L_q - L_qdq qdot) / L_qdqd of a relu network: its second derivatives are 0
    everywhere, +inf in every sample; the hint names the relus, not an eps."""
    rep = nanreplay_json(states_bundle(M.make_relu_lnn, M.pendulum_states(), tmp_path))
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["module"], o["op"]) == \
        (0, "forward", "", "aten.div")
    assert o["made"] == "+inf" and o["samples"] == list(range(32))
    assert o["source"] == line_of("return (l_q - mix * qd) / m")
    assert rep["cause"] == "invalid"
    assert "piecewise-linear activations (relu)" in rep["hint"]
    assert "model's own forward took that derivative" in rep["hint"]
    assert "origin call's output is finite" in rep["hint"]
    assert "tanh" in rep["hint"] and "d.clamp_min(eps)" not in rep["hint"]


def test_tanh_lagrangian_closed_form_is_finite():
    """The same closed form with tanh: finite (the relu hint's counterfactual holds)."""
    torch.manual_seed(0)
    assert torch.isfinite(M.LNN(closed_form=True)(M.pendulum_states()[0])).all()


def test_dead_relu_division_is_no_derivative(tmp_path):
    """A forward's division by a dead relu layer's 0 output, no derivative taken (finite with
    softplus too): no relu-Hessian hint."""
    rep = nanreplay_json(states_bundle(M.make_dead_ratio, M.pendulum_states(), tmp_path))
    o = rep["origin"]
    assert (o["module"], o["op"], rep["cause"]) == ("", "aten.div", "invalid")
    assert "piecewise-linear" not in rep["hint"]


def test_lagrangian_blind_to_a_velocity_has_a_singular_mass_matrix(tmp_path):
    data = M.double_spring_states()
    rep = nanreplay_json(states_bundle(M.make_lnn2_one_velocity, data, tmp_path,
                                       torch.linalg.LinAlgError))
    o = rep["origin"]
    assert (rep["event"]["step"], o["module"], o["op"]) == (0, "", "aten._linalg_solve_ex")
    assert o["source"] == line_of("return torch.linalg.solve(mass, rhs)")
    assert rep["cause"] == "invalid" and "singular in exact arithmetic" in rep["hint"]


def test_leapfrog_with_too_large_a_step_overflows(tmp_path):
    data = M.spring_trajectories(steps=40, dt=0.5)
    rep = nanreplay_json(rollout_bundle(M.make_shnn_big_dt, data, tmp_path))
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["module"], o["op"]) == \
        (0, "forward", "", "aten.mul")
    assert o["source"] == line_of("v = self.V(q).sum() + 0.5 * self.log_k.exp()")
    assert o["samples"] == [0, 2, 8, 10, 15]
    assert rep["cause"] == "overflow" and "smaller dt" in rep["hint"]


def test_log_det_of_a_mass_matrix_with_a_negative_pivot(tmp_path):
    x0, traj = data = M.spring_trajectories()
    negative = (1.0 + 1.5 * x0[:, 0] <= 0).nonzero()[:, 0].tolist()
    rep = nanreplay_json(rollout_bundle(M.make_shnn_raw_diag, data, tmp_path, reg=0.01))
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["module"], o["op"]) == \
        (0, "loss", "<loss>", "aten.log")
    assert o["samples"] == negative == [0, 2, 4, 5, 7, 8, 13]
    assert o["source"] == line_of("return 2.0 * torch.log(torch.diagonal(low")
    assert rep["cause"] == "invalid" and "triangular factor's diagonal" in rep["hint"]
    assert "softplus (or exp) of the raw diagonal" in rep["hint"]
    assert "log barrier" not in rep["hint"]


def test_a_built_factors_diagonal_is_told_from_other_values():
    """With off-diagonal entries written in (index_put at tril_indices), the diagonal of the
    factor the code built is still one; a diagonal of a product of it is not."""
    from replay.factors import made_by

    model = M.SeparableHNN(d=2)
    low = model.cholesky_factor(torch.randn(3, 2))
    assert made_by(low.diagonal(dim1=-2, dim2=-1)) == "built_factor"
    assert made_by((low @ low.mT).diagonal(dim1=-2, dim2=-1)) is None


def test_euclidean_rollout_loss_at_the_trajectory_start_is_a_first_derivative(tmp_path):
    """The rollout returned from its initial state, the loss's sqrt of a sum of squares is 0
    there: +inf in its backward for every trajectory. The model took its own derivative
    (dV/dq, create_graph=True), but never of the loss's sqrt: no second-derivative advice."""
    model, data = M.make_shnn_with_start(), M.spring_trajectories()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with pytest.raises(NonFiniteError) as e:
        with FlightRecorder(model, opt, loss_fn=M.EuclideanRolloutLoss(), out_dir=tmp_path,
                            factory=FACTORY + "make_shnn_with_start") as rec:
            M.fit_rollout(model, opt, rec.loss_fn, *data)
    rep = nanreplay_json(e.value.bundle_path)
    o = rep["origin"]
    assert (rep["event"]["step"], rep["event"]["phase"], o["module"], o["op"]) == \
        (0, "backward", "<loss>", "SqrtBackward0")
    assert o["made"] == "+inf" and o["samples"] == list(range(16))
    assert o["source"] == line_of("return torch.sqrt(((pred - target) ** 2).sum(-1)).mean()")
    assert rep["cause"] == "invalid" and "sqrt(x + eps)" in rep["hint"]
    assert "differentiates the forward again" not in rep["hint"]
