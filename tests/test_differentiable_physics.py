"""End to end on differentiable physics and control (``differentiable_physics_models``): n-body
system identification through a leapfrog rollout, a GNS / MeshGraphNets learned simulator
behind its running-statistics normaliser, Deep Lagrangian Networks, a differentiable LQR, and
a torque policy trained by backpropagation through a long rollout of a kicked rotor. Each is
trained under the recorder until a planted bug of the domain fires, then replayed with the
CLI; the healthy versions train without an event."""

from __future__ import annotations

import differentiable_physics_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

FACTORY = "differentiable_physics_models:"


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("differentiable_physics_models.py", text)


def train_nbody(out_dir, factory: str, sizes_at: dict[int, list[int]], steps: int = 4):
    """Identify the masses of systems of up to six bodies from their simulated trajectories
    (a ground-truth simulator with other masses); ``sizes_at[step]``: the systems' sizes."""
    model, truth = getattr(M, factory)(), M.make_nbody()
    with torch.no_grad():
        truth.log_mass.copy_(torch.linspace(-0.3, 0.3, M.N_BODIES))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    g = torch.Generator().manual_seed(0)
    losses = []
    with FlightRecorder(model, opt, loss_fn=M.trajectory_loss, out_dir=out_dir,
                        factory=FACTORY + factory) as rec:
        for step in range(steps):
            pos, vel, mask = M.nbody_batch(g, sizes_at.get(step, [6, 5, 6, 5]))
            with torch.no_grad():
                target = truth(pos, vel, mask)
            loss = rec.loss_fn(model(pos, vel, mask), target, mask)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.item())
    return losses


def train_gns(out_dir, material: float, steps: int = 25):
    """One-step acceleration training of a GNS-style simulator on scenes of one material,
    with random-walk noise on the input positions (as GNS trains) and a decaying lr."""
    model = M.make_gns()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, 0.999)
    g = torch.Generator().manual_seed(0)
    with FlightRecorder(model, opt, loss_fn=torch.nn.MSELoss(), out_dir=out_dir,
                        factory=FACTORY + "make_gns") as rec:
        for _ in range(steps):
            hist, mat, target = M.gns_batch(g, material=material)
            hist = hist + torch.randn(hist.shape, generator=g).cumsum(1) * 3e-4
            loss = rec.loss_fn(model(hist, mat), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()


def train_rotor(out_dir, factory: str, batch: int, steps: int = 3, record: bool = True):
    """A torque policy trained by backpropagation through the whole rollout: the loss is the
    model's own output (the mean swing-up cost), so no ``loss_fn``."""
    model = getattr(M, factory)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    losses = []
    rec = FlightRecorder(model, opt, out_dir=out_dir, factory=FACTORY + factory) if record \
        else None
    with rec if rec is not None else torch.enable_grad():
        for _ in range(steps):
            theta = torch.rand(batch, generator=g) * 6.28
            omega = torch.rand(batch, generator=g) - 0.5
            loss = model(theta, omega).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses


def test_softening_dropped_for_a_where_names_pow_backward_and_a_safe_input(tmp_path):
    """nbody-python's ``inv_r3[inv_r3 > 0] **= -1.5`` ported as ``torch.where(r2 > 0,
    r2 ** -1.5, 0)`` with no softening: the forward is finite, but the self-pair's r² = 0
    sends 0 * inf through pow's backward in every system. The report names that node and
    line, and says the where does not guard the gradient: make the input safe first."""
    with pytest.raises(NonFiniteError) as info:
        train_nbody(tmp_path, "make_nbody_unsoftened_where", {})
    assert (info.value.event["step"], info.value.event["phase"]) == (0, "backward")
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["samples"]) == (
        True, "invalid", "gravity", "PowBackward0", [0, 1, 2, 3]), rep
    assert o["source"] == line_of("inv_r3 = torch.where(r2 > 0, r2 ** -1.5"), o
    assert "torch.where(mask, x, 1)" in rep["hint"] and "both branches" in rep["hint"], \
        rep["hint"]


def test_two_padded_bodies_at_the_origin_name_their_system_and_the_pole(tmp_path):
    """Systems padded to six bodies park the padding at the origin with mass 0; at step 2
    system 3 has two pads, which coincide: without softening, (r² + eye)^-1.5 is 1/0 there
    (the eye only guards the self-pair). The report names aten.pow in ``gravity``, that
    system alone, and asks to keep the base away from 0."""
    with pytest.raises(NonFiniteError) as info:
        train_nbody(tmp_path, "make_nbody_unsoftened", {2: [6, 5, 6, 4]})
    assert (info.value.event["step"], info.value.event["phase"]) == (2, "forward")
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"], o["samples"],
            o["call"]) == (True, "invalid", "gravity", "aten.pow", "+inf", [3], 0), rep
    assert o["source"] == line_of("inv_r3 = (r2 + eye) ** -1.5"), o
    assert "of 0 to a negative power" in rep["hint"] and "clamp_min(eps)" in rep["hint"], \
        rep["hint"]


def test_healthy_rollouts_train_without_an_event(tmp_path):
    """Softened gravity with padded systems, a GNS normaliser over an exactly representable
    material, a DeLaN with its SoftPlus diagonal and a short rotor rollout: no event, no
    bundle, and the rotor's losses are those of the run without the recorder."""
    train_nbody(tmp_path, "make_nbody", {1: [6, 4, 3, 2]})
    train_gns(tmp_path, material=2.5, steps=6)
    model = M.make_delan()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    with FlightRecorder(model, opt, loss_fn=torch.nn.MSELoss(), out_dir=tmp_path,
                        factory=FACTORY + "make_delan") as rec:
        for _ in range(3):
            q, qd, tau, qdd = M.pendulum2_batch(g)
            loss = rec.loss_fn(model(q, qd, tau), qdd)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert train_rotor(tmp_path, "make_short_rotor", 8) == \
        train_rotor(tmp_path, "make_short_rotor", 8, record=False)
    assert not list(tmp_path.glob("*.nan"))


def test_a_running_variance_cancelled_below_zero_is_precision_not_a_parametrisation(tmp_path):
    """MeshGraphNets' normaliser takes std = sqrt(E[x²] − E[x]²) of sums it accumulates in
    float32 buffers. Over a dataset of one material the material feature is constant, so
    the two terms agree to rounding, and after 21 steps' accumulations the difference is
    -1.5e-8: sqrt is NaN, and torch.maximum(std, std_epsilon) passes the NaN on. The float64
    re-run of the step reads the same float32 sums and crosses 0 too; it was reported as
    ``invalid`` with a parametrisation's hint ("a scale trained to 0"), which sends the user
    to the weights. Now: ``precision``, a cancelled difference, clamp it or use Welford."""
    with pytest.raises(NonFiniteError) as info:
        train_gns(tmp_path, material=0.3)
    assert (info.value.event["step"], info.value.event["phase"]) == (21, "forward")
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"], o["call"]) == (
        True, "precision", "node_normalizer", "aten.sqrt", "nan", 0), rep
    assert o["samples"] == list(range(64)), o  # (one std for every particle's features)
    assert o["source"] == line_of("std = torch.sqrt(self._acc_sum_squared"), o
    hint = rep["hint"]
    assert "E[x²] − E[x]²" in hint and "clamp_min(0)" in hint and "Welford" in hint, hint
    assert "parametrisation" not in hint and "exact arithmetic makes too" not in hint, hint
    # (float64 reads the same float32 sums: the terms brought the rounding in, not a spread of 0)
    assert "accumulated over earlier steps in buffers" in hint and "spread" not in hint, hint


def test_a_chaotic_rollouts_backward_overflow_says_the_gradient_exploded_through_time(tmp_path):
    """A kicked rotor (K = 12) rolled out 60 steps: θ and ω are wrapped, so the forward stays
    bounded, but the gradient through the rollout grows about 6x a step until a product
    overflows in the backward. It was reported as a plain overflow ("subtract the row max
    before exp ... or compute it in float64"); now the report says the gradient entering
    that line's node grew step after step, and asks for a shorter or truncated backward."""
    with pytest.raises(NonFiniteError) as info:
        train_rotor(tmp_path, "make_rotor", 4)
    assert (info.value.event["step"], info.value.event["phase"]) == (0, "backward")
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["phase"], o["module"]) == (
        True, "overflow", "backward", ""), rep
    assert o["source"] in {line_of("omega = omega + self.kick * force"),
                           line_of("omega = torch.remainder(omega"),
                           line_of("theta = torch.remainder(theta + omega")}, o
    assert o["samples"], o
    hint = rep["hint"]
    assert "backpropagation through the rollout is exploding" in hint \
        and "truncate the backward" in hint and "float64 only postpones" in hint, hint
    assert "row max" not in hint, hint
    assert any("exploding gradients through time" in p and o["source"] in p
               for p in rep["problems"]), rep["problems"]


def test_gradients_summed_into_an_infinity_name_the_value_they_were_summed_for(tmp_path):
    """The cat map (the rotor's small-angle kick, K = 1) over 100 steps: every backward node
    multiplies by at most 1, and the gradient grows only where the engine adds up the
    gradients of θ's four uses. No node returns the infinity, so the backward origin was
    empty ("nan in the gradient of policy.net.0.weight", no line, no samples). Now the
    origin is the sum into θ's node, on θ's line, with its samples and the through-time
    growth."""
    with pytest.raises(NonFiniteError) as info:
        train_rotor(tmp_path, "make_cat_map", 4)
    assert (info.value.event["step"], info.value.event["phase"]) == (0, "backward")
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["op"], o["made"]) == (
        True, "overflow", "RemainderBackward0", "+inf"), rep
    assert o["source"] == line_of("theta = torch.remainder(theta + omega"), o
    assert "the sum of 4 finite gradients" in o["detail"] \
        and "autograd engine added them up" in o["detail"], o
    assert o["samples"] and set(o["samples"]) <= {0, 1, 2, 3}, o
    assert "the sum of the gradients into RemainderBackward0 overflowed" in rep["hint"] \
        and "truncate the backward" in rep["hint"], rep["hint"]


def test_a_delan_mass_matrix_with_a_dead_relu_diagonal_names_its_singular_configurations(
        tmp_path):
    """DeLaN with ReLU (no offset) on the diagonal of L: configurations whose pre-activation
    is below 0 get a zero pivot and H = L Lᵀ is singular, so ``torch.linalg.solve`` raises in
    a forward that took ``autograd.grad`` of the potential. The error reaches the loop as it
    was, with the bundle's note; the replay names the solve, its line, exactly the singular
    configurations, ``invalid`` (singular in float64 too) and a ridge on the diagonal."""
    model = M.make_delan_relu()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    q, qd, tau, qdd = M.pendulum2_batch(g)
    with torch.no_grad():
        singular = (model.ld(model.body(q)) <= 0).any(1).nonzero().flatten().tolist()
    with pytest.raises(torch.linalg.LinAlgError) as info:
        with FlightRecorder(model, opt, loss_fn=torch.nn.MSELoss(), out_dir=tmp_path,
                            factory=FACTORY + "make_delan_relu") as rec:
            loss = rec.loss_fn(model(q, qd, tau), qdd)
            opt.zero_grad()
            loss.backward()
            opt.step()
    bundles = sorted(tmp_path.glob("*.nan"))
    assert len(bundles) == 1 and any(str(bundles[0]) in n for n in info.value.__notes__)
    rep = nanreplay_json(bundles[0])
    o = rep["origin"]
    assert 0 < len(singular) < len(q), singular
    assert (rep["event"]["step"], rep["reproduced"], rep["cause"], o["phase"], o["op"],
            o["samples"]) == (0, True, "invalid", "forward", "aten._linalg_solve_ex",
                              singular), rep
    assert o["source"] == line_of("return torch.linalg.solve(H, (tau - g)"), o
    assert "singular in exact arithmetic too" in rep["hint"] and "ridge" in rep["hint"], \
        rep["hint"]


def test_a_near_singular_lqr_solve_whose_update_blew_the_weights_up_says_the_run_diverged(
        tmp_path):
    """A differentiable LQR whose second actuator costs nothing and barely acts (its column
    of B is 1e-4 of the first's): Quu = R + BᵀPB is near-singular, the gains from
    ``torch.linalg.solve`` are huge, the imitation loss is 4e7 and its gradient 2e12, and
    SGD's first update takes B from 0.36 to 1e11. At step 1, BᵀPB overflows. With only step
    0 before the event no precursor had a baseline, and the hint said to rescale the op's
    inputs or use float64; the weights' norm the recorder measured before the first update
    is the baseline now: a weight jump in the update before step 1, a diverging run."""
    model, expert = M.make_lqr_weak(), M.make_lqr()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=torch.nn.MSELoss(), out_dir=tmp_path,
                            factory=FACTORY + "make_lqr_weak") as rec:
            for _ in range(4):
                x0 = torch.randn(16, M.NX, generator=g)
                with torch.no_grad():
                    target = expert(x0)
                loss = rec.loss_fn(model(x0), target)
                opt.zero_grad()
                loss.backward()
                opt.step()
    assert (info.value.event["step"], info.value.event["phase"]) == (1, "forward")
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["op"], o["module"]) == (
        True, "overflow", "aten.mm", ""), rep
    assert o["source"] == line_of("Quu = self.R + self.B.T @ P @ self.B"), o
    assert [(p["step"], p["kind"]) for p in rep["precursors"]] == [(1, "weight_jump")], \
        rep["precursors"]
    assert "jumped in the update before step 1" in rep["hint"] \
        and "the run was diverging" in rep["hint"] \
        and "lower the learning rate" in rep["hint"], rep["hint"]


def test_a_particle_tunnelling_through_the_ipc_barrier_names_its_log_and_its_row(tmp_path):
    """IPC's barrier force has log(d / d̂): at step 3 particle 5 is thrown at the floor at
    12 m/s, crosses the whole barrier in one Euler step and lands at d < 0, where the log is
    NaN. The report names aten.log on the barrier line, that particle alone, ``invalid``
    (a negative number in exact arithmetic too) and the domain advice."""
    model = M.make_contact()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=torch.nn.MSELoss(), out_dir=tmp_path,
                            factory=FACTORY + "make_contact") as rec:
            for step in range(5):
                pos, vel = M.contact_batch(g, fast_row=5 if step == 3 else None)
                loss = rec.loss_fn(model(pos, vel), pos[:, None].expand(-1, model.steps, -1))
                opt.zero_grad()
                loss.backward()
                opt.step()
    assert (info.value.event["step"], info.value.event["phase"]) == (3, "forward")
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["op"], o["made"], o["samples"]) == (
        True, "invalid", "aten.log", "nan", [5]), rep
    assert o["source"] == line_of("grad = -2 * (d - dh) * torch.log(d / dh)"), o
    assert "log of a negative number" in rep["hint"] and "clamp" in rep["hint"], rep["hint"]
