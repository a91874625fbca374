"""End to end on differentiable control (``differentiable_control_models``): a point-mass
policy under a log barrier, a differentiable MPC layer's Riccati recursion by Cholesky, a
cart-pole policy trained through its simulator with per-episode control periods, and a learned
pendulum model whose loss wraps angles with ``atan2``. Each planted bug of the domain fires
under the recorder and is replayed with the CLI; the healthy versions raise no event and train
bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import differentiable_control_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("differentiable_control_models.py", text)


def batch(kind: str, g: torch.Generator, bad: int | None):
    """(model args, loss args after the model's outputs) of one step."""
    if kind == "barrier":
        x0, goal = M.start_states(g, outside=bad)
        return (x0,), (goal,)
    if kind == "limits":
        x0, goal = M.start_states(g, fast=bad)
        return (x0,), (goal,)
    if kind == "mpc":
        x0, u_star = M.pendulum_states(g, fallen=bad)
        return (x0,), (u_star,)
    if kind == "cartpole":
        return M.cartpole_batch(g, slow=bad), ()
    if kind == "pinet":
        x0, u_star = M.expert_batch(g, far=bad)
        return (x0,), (u_star,)
    x, u, y, mask = M.episodes(g, short=bad)
    return (x, u, mask), (y, mask)


LOSSES = {"barrier": M.barrier_loss, "cartpole": M.cartpole_cost, "dynamics": M.angle_loss,
          "circle": M.angle_loss_on_circle, "limits": M.control_barrier_loss}


def train(kind: str, make: str, out_dir, bad: int | None = None, steps: int = 4,
          record: bool = True):
    """Adam with a step schedule and gradient clipping, as control-learning code trains; the
    sample ``bad`` is planted in the last step's batch. Returns the model."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    crit = LOSSES.get(kind, torch.nn.MSELoss())
    g = torch.Generator().manual_seed(0)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"differentiable_control_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for step in range(steps):
            args, targets = batch(kind, g, bad if step == steps - 1 else None)
            out = model(*args)
            loss = loss_fn(*(out if isinstance(out, tuple) else (out,)), *targets)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
    return model


def fire(kind: str, make: str, tmp_path, bad: int):
    with pytest.raises(NonFiniteError) as info:
        train(kind, make, tmp_path, bad)
    return info.value.event, info.value.bundle_path


def test_log_barrier_at_an_infeasible_start_names_the_log_and_the_record(tmp_path):
    """The interior-point barrier -mu (log(p_max - p) + log(p_max + p)) is defined only inside
    the box; a start state drawn past the limit (1.3 > 1) puts the rollout's positions
    outside, and the log of the negative slack is NaN in the loss. The replay names that log,
    its line, the record and ``invalid`` math of a negative number, and says that a clamp
    would hide a barrier's violation: start feasible, or relax the barrier."""
    ev, bundle = fire("barrier", "make_barrier", tmp_path, bad=5)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (3, "loss", "<loss>", "nan"), ev
    rep = nanreplay_json(bundle, "--try", "drop=5")
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "<loss>", "aten.log", "nan", [5]), o
    assert o["source"] == line_of("barrier = -mu * (torch.log(P_MAX - ps)"), o
    hint = rep["hint"]
    assert rep["cause"] == "invalid" and "of a negative number" in hint, hint
    # (was only "x.clamp_min(eps) before log or sqrt", which hides a barrier's violation)
    assert "log barrier" in hint and "start feasible" in hint and "relaxed log barrier" in hint, \
        hint
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_control_limit_barrier_of_a_saturated_tanh_is_precision_with_its_stable_form(
        tmp_path):
    """A ReLU policy acts in normalised units a = tanh(z), its control limit a barrier
    -mu log(1 - a²) in the loss. A record whose velocity was logged in mm/s (600) drives z
    past 9, where tanh is 1.0 in float32 (float64 keeps 1 - a² at 2e-15): log(0) on that
    record. The actions reach the loss stacked over the rollout, one tanh per step; that
    stack hid the tanh, so the report said a cancellation "as in a variance" with its
    advice. Now: ``precision``, 1 - y of a tanh rounded to 1, and the complement's stable
    form 2·(log 2 − u − softplus(−2u))."""
    ev, bundle = fire("limits", "make_relu_barrier", tmp_path, bad=9)
    assert (ev["step"], ev["phase"], ev["kind"]) == (3, "loss", "+inf"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "<loss>", "aten.log", "-inf", [9]), o
    assert o["source"] == line_of("barrier = -mu * torch.log(1 - actions ** 2)"), o
    hint = rep["hint"]
    assert rep["cause"] == "precision" and "that 0 is 1 − y of a y (tanh" in hint, hint
    assert "2·(log 2 − u − softplus(−2u))" in hint and "variance" not in hint, hint


def test_riccati_cholesky_of_an_indefinite_q_uu_says_negative_curvature(tmp_path):
    """A differentiable MPC layer expands the swing-up cost 1 - cos(th) at each record's
    start: for a pendulum hanging down (th = 3.1) its curvature cos(th) is negative, and six
    steps into the Riccati recursion Q_uu = R + B^T V B is negative: ``cholesky`` raises. The
    replay names the Cholesky in the root's forward, its line, the record (batch element 3),
    and says the matrix is indefinite in float64 too, fixed by a regularisation larger than
    its negative eigenvalue (Levenberg-Marquardt's mu) or a Gauss-Newton curvature; not
    "linearly dependent rows" and a small ridge, which do not reach a negative eigenvalue."""
    with pytest.raises(torch.linalg.LinAlgError):
        train("mpc", "make_mpc", tmp_path, bad=3)
    (bundle,) = tmp_path.glob("*.nan")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["phase"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "forward", "", "aten.linalg_cholesky_ex", "LinAlgError", [3]), o
    assert o["source"] == line_of("L = torch.linalg.cholesky(Q_uu)"), o
    hint = rep["hint"]
    assert rep["cause"] == "invalid" and "indefinite in exact arithmetic too" in hint, hint
    assert "batch element 3" in hint and "Levenberg-Marquardt" in hint \
        and "Gauss-Newton" in hint, hint
    assert "linearly dependent" not in hint, hint


def test_cartpole_episode_with_a_period_in_milliseconds_names_the_diverging_euler_step(
        tmp_path):
    """Domain randomisation of the control period with one episode's dt logged in ms (20
    read as 20 s): semi-implicit Euler of the cart-pole diverges over the rollout and a
    product overflows in the root's own loop. The replay names that product on the record's
    row, an overflow of diverging iterates, and the dt argument's out-of-scale row; dropping
    the episode makes the step finite."""
    ev, bundle = fire("cartpole", "make_cartpole", tmp_path, bad=6)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (3, "forward", "", [6]), ev
    rep = nanreplay_json(bundle, "--try", "drop=6")
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "", "aten.mul", "+inf", [6]), o
    assert o["source"] == line_of("x = x + dt * x_dot"), o
    hint = rep["hint"]
    assert rep["cause"] == "overflow" and "diverging" in hint, hint
    assert "sample(s) 6 of args[1] reach 20" in hint, hint
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_hand_written_radius_of_padded_predictions_names_sqrt_backward(tmp_path):
    """A learned pendulum model's predictions are zeroed on the padded steps of an episode
    that ended early; the loss keeps (cos, sin) on the unit circle with a radius written as
    sqrt(c² + s²), whose derivative is 0/0 at those zeros though the mask removes them from
    the loss. A backward event: the replay names SqrtBackward0 in the loss on the episode's
    row, and asks for vector_norm or a safe input rather than a mask after the op."""
    ev, bundle = fire("circle", "make_dynamics", tmp_path, bad=2)
    assert (ev["step"], ev["phase"], ev["kind"]) == (3, "backward", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "<loss>", "SqrtBackward0", "nan", [2]), o
    assert o["source"] == line_of("radius = torch.sqrt(pred[..., 0] ** 2"), o
    hint = rep["hint"]
    assert rep["cause"] == "invalid" and "torch.linalg.vector_norm" in hint \
        and "both branches" in hint, hint


def test_mppi_weights_of_a_far_record_underflow_to_0_over_0(tmp_path):
    """PI-Net's path-integral weights exp(-S / lambda), normalised by their sum as written
    by hand: a record 12 units from the goal has every sampled cost above 104, every weight
    underflows to 0 and the normalisation is 0/0. The replay names that division on the
    record's row as an underflow of exps normalised by their own sum, asks for softmax (the
    row's max subtracted) rather than a clamp, and names the record's out-of-scale state."""
    ev, bundle = fire("pinet", "make_pinet", tmp_path, bad=4)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (3, "forward", "", [4]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "", "aten.div", "nan", [4]), o
    assert o["source"] == line_of("w = w / w.sum(1, keepdim=True)"), o
    hint = rep["hint"]
    assert rep["cause"] == "underflow" and "torch.softmax(s, dim)" in hint, hint
    # (was the generic "... or clamp the value away from 0 (x.clamp_min(eps)) before log or
    # division", which makes every weight of the record 0)
    assert "clamp_min" not in hint and "subtract the max" in hint, hint
    assert "sample(s) 4 of batch reach 12" in hint, hint


@pytest.mark.parametrize("kind,make,bad", [
    ("barrier", "make_barrier", None), ("limits", "make_relu_barrier", None),
    ("mpc", "make_mpc_gauss_newton", 3),
    ("cartpole", "make_cartpole", None), ("dynamics", "make_dynamics", 2),
    ("pinet", "make_pinet_softmax", 4)])
def test_healthy_controllers_raise_nothing_and_train_the_same(tmp_path, kind, make, bad):
    """The fixed versions on the same kind of batches: feasible starts under the barrier,
    the Gauss-Newton curvature with the hanging pendulum in the batch, 10-30 ms control
    periods, atan2 of the padded steps' (0, 0) (torch's atan2 backward is 0 there) with the
    masked loss, and softmax weights for the far record: no event, and bit-identical weights
    with and without the recorder."""
    recorded = train(kind, make, tmp_path, bad, steps=3)
    plain = train(kind, make, tmp_path, bad, steps=3, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.isfinite(a).all() and torch.equal(a, b), name
