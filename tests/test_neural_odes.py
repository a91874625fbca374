"""End to end on hand-written neural ODEs and continuous normalising flows
(``neural_odes_models``): an adaptive Dormand-Prince solver whose ODE function runs dozens of
times per step, a fixed-step RK4 through thermal runaway, FFJORD's CNF (``autograd.grad`` with
``create_graph=True`` inside forward, Hutchinson noise from ``randn_like``), a latent ODE fed
each record's observation times, and the adjoint method as a custom autograd Function whose
backward calls the ODE function again. Each planted bug of the domain fires under the recorder
and is replayed with the CLI; the healthy versions raise no event and train bit-identically
with and without the recorder."""

from __future__ import annotations

import contextlib

import neural_odes_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("neural_odes_models.py", text)


def batch(kind: str, g: torch.Generator, bad: int | None):
    """(model args, loss args after the model's outputs) of one step."""
    if kind == "adaptive":
        y0, t1, target = M.spiral_batch(g, bad)
        return (y0, t1), (target,)
    if kind == "ignition":
        y0, target = M.ignition_batch(g, bad)
        return (y0,), (target,)
    if kind == "adjoint":
        y0, _, target = M.spiral_batch(g, bad)
        return (y0,), (target,)
    if kind == "cnf":
        return (M.moons_batch(g, bad),), ()
    if kind == "cnf_rbf":
        return (M.moons_with_centre(g, bad),), ()
    x, times, mask = M.irregular_batch(g, bad)
    return (x, times), (x, mask)


LOSSES = {"cnf": M.cnf_loss, "cnf_rbf": M.cnf_loss, "latent": M.latent_loss}


def train(kind: str, make: str, out_dir, bad: int | None = None, steps: int = 4,
          record: bool = True):
    """Adam with a cosine schedule and gradient clipping, as the torchdiffeq/FFJORD examples
    train; the sample ``bad`` is planted in the last step's batch. Returns the model."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    crit = LOSSES.get(kind, torch.nn.MSELoss())
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(1)  # (the CNF's Hutchinson noise, the latent ODE's reparameterisation)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"neural_odes_models:{make}") if record else None
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


def test_adaptive_initial_step_of_a_state_at_zero_names_the_division_and_its_sample(tmp_path):
    """Hairer's starting step ``h0 = 0.01 d0 / d1`` is 0 for a sample at the origin, and
    ``d2 = |f1 - f0| / h0`` is 0/0 there. The solver's ``torch.where`` keeps the NaN step out of
    the state, so the model output and the loss stay finite, while the NaN reaches the ODE
    function's calls (and, unrecorded, the weights through the where's backward). The event
    names the root's own code and the first call of ``func`` that took the NaN in; the replay
    names the division, its line and sample 5 only: the solver's step factor
    ``(0.9 * ratio ** -0.2).clamp(0.2, 10)`` is +inf in every finished row (ratio 0, h 0), which
    the clamp takes back, so those rows are not the NaN's samples."""
    ev, bundle = fire("adaptive", "make_adaptive", tmp_path, bad=5)
    assert (ev["step"], ev["phase"], ev["module"], ev["call"], ev["kind"]) == (
        3, "forward", "", 0, "nan"), ev
    assert ev["detail"].endswith("whose output is finite; first taken in by func (call 2)"), ev
    rep = nanreplay_json(bundle, "--try", "drop=5")
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "", "aten.div", "nan", [5]), o
    assert o["source"] == line_of("d2 = rms((f1 - f0) / scale) / h0"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_unrecorded_adaptive_solver_goes_nan_silently(tmp_path):
    """Without the recorder the same run's loss stays finite and its weights turn NaN: the
    event above is the bug, not a false alarm."""
    model = train("adaptive", "make_adaptive", tmp_path, bad=5, record=False)
    assert not all(torch.isfinite(p).all() for p in model.parameters())


def test_guarded_adaptive_solver_raises_nothing_and_trains_the_same(tmp_path):
    """torchdiffeq's guard (a state or slope near 0 starts from 1e-6) on the same batches: no
    event, though the step factor is +inf (then clamped) in every finished row of every solve,
    and the weights are bit-identical with and without the recorder."""
    recorded = train("adaptive", "make_adaptive_guarded", tmp_path, bad=5)
    plain = train("adaptive", "make_adaptive_guarded", tmp_path, bad=5, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def first_overflowing_call(bad: int) -> tuple[int, list[int]]:
    """The call of ``func`` that first returns a non-finite value in the last step's forward,
    and its rows, counted by a hook on an unrecorded copy of the run (the replay's claim,
    checked independently)."""
    model = train("ignition", "make_ignition", None, steps=3, record=False)
    g = torch.Generator().manual_seed(0)
    for step in range(4):
        (y0,), _ = batch("ignition", g, bad if step == 3 else None)
    calls: list[torch.Tensor] = []
    model.func.register_forward_hook(lambda m, i, o: calls.append(o.detach()))
    model(y0)
    k = next(i for i, o in enumerate(calls) if not torch.isfinite(o).all())
    return k, torch.nonzero(~torch.isfinite(calls[k]).all(1)).flatten().tolist()


def test_rk4_thermal_runaway_names_the_exp_at_the_call_it_overflowed(tmp_path):
    """A record starting past ignition: ``y' = e^y`` blows up within the horizon, RK4 follows
    it up, and ``exp(y)`` overflows in one of the ~40 calls of ``func`` in the step. The
    recorder and the replay name that call (the same one a hook counts on an unrecorded run),
    its sample, the exp on its line, and say the iterates of func were diverging."""
    call, rows = first_overflowing_call(bad=3)
    assert call > 20 and rows == [3], (call, rows)
    ev, bundle = fire("ignition", "make_ignition", tmp_path, bad=3)
    assert (ev["step"], ev["module"], ev["call"], ev["samples"], ev["kind"]) == (
        3, "func", call, rows, "+inf"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["call"], o["op"], o["samples"]) == ("func", call, "aten.exp", rows), o
    assert o["source"] == line_of("self.log_a.exp() * torch.exp(y)"), o
    assert rep["cause"] == "overflow" and "diverging" in rep["hint"], rep["hint"]


def test_cnf_fill_value_in_the_data_names_the_normal_log_density_and_the_record(tmp_path):
    """A missing measurement stored as netCDF's fill value 1e20 flows through FFJORD's CNF
    (Hutchinson divergence by autograd.grad inside forward) to z ≈ 1e20, whose z² in the
    standard normal's log-density overflows: a loss event, named at that pow, on sample 7,
    with the record's out-of-scale data in the hint; dropping it makes the step finite."""
    ev, bundle = fire("cnf", "make_cnf", tmp_path, bad=7)
    assert (ev["step"], ev["phase"]) == (3, "loss"), ev
    rep = nanreplay_json(bundle, "--try", "drop=7")
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"]) == (
        "loss", "<loss>", "aten.pow", [7]), o
    assert o["source"] == line_of("return -0.5 * math.log(2 * math.pi) - z.pow(2) / 2"), o
    assert rep["cause"] == "overflow" and "out of scale" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


@pytest.mark.parametrize("kind,make", [("cnf", "make_cnf"), ("adjoint", "make_adjoint"),
                                       ("latent", "make_latent"), ("ignition", "make_ignition")])
def test_healthy_runs_raise_nothing_and_train_the_same(tmp_path, kind, make):
    """The CNF (autograd.grad with create_graph=True in every one of its 16 calls per step,
    noise from randn_like), the adjoint ODE (its Function's backward calls func again, under
    the recorder's hooks), the latent ODE (a GRU, the reparameterisation's randn_like, each
    record's own times) and the RK4 rollout: no event, bit-identical weights with and
    without the recorder."""
    recorded = train(kind, make, tmp_path, steps=3)
    plain = train(kind, make, tmp_path, steps=3, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_latent_ode_negative_time_span_names_the_rk4_step_and_the_record(tmp_path):
    """One record's timestamp is in minutes among hours (300 then 4.x: a span of about
    -296), so RK4 steps far outside its stability region, backwards through a decaying
    field, and the latent state overflows within the root's own loop. The replay names an op
    of that loop on the record's row, overflow of diverging iterates, and the times tensor's
    out-of-scale row; dropping the record makes the step finite."""
    ev, bundle = fire("latent", "make_latent", tmp_path, bad=2)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (3, "forward", "", [2]), ev
    rep = nanreplay_json(bundle, "--try", "drop=2")
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == (
        "", "aten.mul", [2], "overflow"), rep
    assert o["source"] == line_of("k2 = self.func(times[:, i], z + h / 2 * k1)"), o
    assert "diverging" in rep["hint"] and "args[1]" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def func_calls_until_non_finite(make: str, kind: str) -> tuple[int, list[int]]:
    """The first call of ``model.func`` (forward and backward alike) that returns a
    non-finite value in an unrecorded first step, and its rows."""
    model = getattr(M, make)()
    outs: list[torch.Tensor] = []
    model.func.register_forward_hook(lambda m, i, o: outs.append(o.detach()))
    args, targets = batch(kind, torch.Generator().manual_seed(0), None)
    torch.nn.functional.mse_loss(model(*args), *targets).backward()
    k = next(i for i, o in enumerate(outs) if not torch.isfinite(o).all())
    return k, torch.nonzero(~torch.isfinite(outs[k]).all(1)).flatten().tolist()


def test_adjoint_reverse_solve_names_the_func_call_its_backward_made(tmp_path):
    """The adjoint method's backward rebuilds y(t) by integrating a strongly damped field
    from t1 back to 0, which is unstable (the damping turns into growth): ``func``, called
    again by the custom Function's backward, overflows in ``self.damping * y``. Its call comes
    after the forward's 320, so a forward-only re-run never reached it (no op was named, and
    the hint spoke of a pole of a derivative the forward took, the bisection DISAGREED); the
    replay now re-runs the backward to reach it, names the op on its line and its rows, says
    it ran there, and runs no forward-only bisection for it."""
    call, rows = func_calls_until_non_finite("make_adjoint_damped", "adjoint")
    assert call > 4 * 80, call  # (after every call of the forward's RK4)
    with pytest.raises(NonFiniteError) as info:
        train("adjoint", "make_adjoint_damped", tmp_path, steps=1)
    ev, bundle = info.value.event, info.value.bundle_path
    assert (ev["step"], ev["module"], ev["call"]) == (0, "func", call), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["call"], o["op"], o["samples"]) == ("func", call, "aten.mul", rows), o
    assert o["source"] == line_of("return self.net(y) - self.damping * y"), o
    assert rep["cause"] == "overflow" and "pole" not in rep["hint"], rep["hint"]
    assert "node" not in o, o
    assert any(p.startswith(f"func call {call} ran in the backward pass")
               for p in rep["problems"]), rep["problems"]
    assert rep["bisection"] is None  # (its forward-only probes never reach that call)


def test_cnf_hutchinson_grad_at_an_rbf_centre_names_sqrt_backward_inside_forward(tmp_path):
    """An RBF network as the CNF's dynamics, its centres picked from training points: at
    t = 0 the record that was a centre sits on it, and the Hutchinson estimator's
    autograd.grad (create_graph=True, inside the ODE function's forward) runs SqrtBackward0 of
    the hand-written distance at 0. The event is the ODE function's first call of the step
    (its divergence output NaN on that row); the replay names the division inside that node,
    the autograd.grad line, the sqrt's own line as the node's source, and the row."""
    ev, bundle = fire("cnf_rbf", "make_cnf_rbf", tmp_path, bad=11)
    assert (ev["step"], ev["module"], ev["call"], ev["samples"], ev["kind"]) == (
        3, "odefunc", 0, [11], "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["call"], o["op"], o["node"], o["samples"]) == (
        "odefunc", 0, "aten.div", "SqrtBackward0", [11]), o
    assert o["source"] == line_of("e_dzdz = torch.autograd.grad(dz, z, self.e"), o
    assert o["node_source"] == line_of("r = ((u[:, None, :] - self.centres[None]) ** 2)"), o
    assert rep["cause"] == "invalid" and "pole" in rep["hint"], rep["hint"]


def test_zero_initialised_field_makes_the_unguarded_initial_step_infinite(tmp_path):
    """The ODE function's last layer zero-initialised (a flow starting as the identity): its
    slope is 0 in every row, Hairer's ``h0 = 0.01 d0 / d1`` is +inf, and ``h0 * f0`` is NaN
    in the next line, handed to func's call 1. The event is the root's own code at step 0;
    the replay names the division, every row, and the zero layer's weight as the divisor's
    source."""
    with pytest.raises(NonFiniteError) as info:
        train("adaptive", "make_adaptive_zero_init", tmp_path, steps=2)
    ev = info.value.event
    assert (ev["step"], ev["module"], ev["kind"]) == (0, "", "nan"), ev
    assert ev["detail"].endswith("first taken in by func (call 1)"), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["all_samples"]) == (
        "", "aten.div", "+inf", True), o
    assert o["source"] == line_of("h0 = 0.01 * d0 / d1"), o
    assert [c["source"] for c in o["chain"]] == [o["source"], line_of(
        "f1 = func(t0 + h0, y0 + h0[:, None] * f0)")], o["chain"]
    assert rep["cause"] == "invalid" and "func.net.2.weight, all 0" in rep["hint"], rep["hint"]
