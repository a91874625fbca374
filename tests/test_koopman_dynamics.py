"""End to end on Koopman operator learning (``koopman_dynamics_models``): a deep Koopman
autoencoder with a multi-step loss over ``matrix_power(K, k)``, a spectral regulariser and an
eigenfunction loss through ``torch.linalg.eig``, a continuous-time generator's
``matrix_exp(L dt)`` with each record's own time step, and DMD in a learned latent space (SVD,
rank truncation, the pseudo-inverse's division by the singular values), trained on pendulum
trajectories from an RK4 simulator through a DataLoader. Each planted failure of the domain
fires under the recorder and is replayed with the CLI; the healthy versions raise no event and
train bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import koopman_dynamics_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line
from torch.utils.data import DataLoader

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

LOSSES = {"make_deep_koopman": M.koopman_loss, "make_deep_koopman_gain": M.koopman_loss,
          "make_spectral": M.spectral_loss, "make_spectral_eye": M.spectral_loss,
          "make_continuous": M.koopman_loss, "make_latent_dmd": M.dmd_loss,
          "make_deep_koopman_lorenz": M.koopman_loss}


def line_of(text: str) -> str:
    return source_line("koopman_dynamics_models.py", text)


def train(make: str, out_dir, steps: int = 12, rest=(), dt_ms=(), coarse=None,
          record: bool = True, bf16: bool = False, dt: float = 0.1):
    """Adam with a step schedule and gradient clipping over 4 batches of 8 trajectories
    (``steps`` states each, in dataset order: record 27 is sample 3 of step 3, record 29
    sample 5); Lorenz trajectories when ``coarse`` is given; the forward under bfloat16
    autocast with ``bf16``. Returns the model."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    crit = LOSSES[make]
    data = M.PendulumTrajectories(n=32, steps=steps, dt=dt, rest=rest, dt_ms=dt_ms) \
        if coarse is None else M.LorenzTrajectories(n=32, steps=steps, coarse=coarse)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"koopman_dynamics_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for x, dt in DataLoader(data, batch_size=8):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                out = model(x, dt) if make == "make_continuous" else model(x)
            loss = loss_fn(*(o.float() for o in out), x)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
    return model


def fire(make: str, tmp_path, **kw):
    with pytest.raises(NonFiniteError) as info:
        train(make, tmp_path, **kw)
    return info.value.event, info.value.bundle_path


def test_operator_with_spectral_radius_above_one_overflows_its_long_horizon_power(tmp_path):
    """K initialised orthogonal with a gain of 1.5 (a recipe's gain for ReLU layers): its
    spectral radius is 1.5 and ``matrix_power(K, k)`` passes float32's largest value at
    k = 219 of a 239-step horizon, in the first step. The replay names the mm of that line, on
    the weights alone, and says the operator's powers grow with its spectral radius above 1 (a
    stable operator is the fix), not "rescale the inputs or compute in float64"."""
    ev, bundle = fire("make_deep_koopman_gain", tmp_path, steps=240)
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "forward", ""), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"]) == ("", "aten.mm", "+inf"), o
    assert o["source"] == line_of("powers = torch.stack([torch.linalg.matrix_power("), o
    assert rep["cause"] == "overflow", rep["hint"]
    assert "made of the weights alone, with spectral radius" in rep["hint"], rep["hint"]
    assert "spectral radius at most 1" in rep["hint"], rep["hint"]
    assert "normalise before a product" not in rep["hint"], rep["hint"]


def test_time_step_in_milliseconds_overflows_the_generator_rollout_on_that_record(tmp_path):
    """One record's time step was exported in milliseconds (100 for 0.1 s): its
    ``matrix_exp(L dt)`` is finite but huge and the rollout ``K z`` overflows at its fourth
    application. The replay names the einsum's bmm on that line, sample 5 only, and the
    model's ``dt`` argument out of scale in that row; dropping the record makes the step
    finite."""
    ev, bundle = fire("make_continuous", tmp_path, dt_ms=(29,))
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (3, "forward", "", [5]), ev
    rep = nanreplay_json(bundle, "--try", "drop=5")
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"]) == ("", "aten.bmm", [5]), o
    assert o["source"] == line_of('z_adv = torch.einsum("bij,bj->bi", K, z_adv)'), o
    assert rep["cause"] == "overflow", rep["hint"]
    assert "sample(s) 5 of args[1]" in rep["hint"] and "out of scale" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_time_step_in_milliseconds_overflows_the_generator_matrix_exp_itself(tmp_path):
    """Sampled at 1 s, one record's step exported in milliseconds: ``matrix_exp(L * 1000)``
    itself overflows on that record. The replay names the matrix exponential on its line,
    sample 5, says it grows as e^(max Re lambda) of the matrix it was given (not "subtract the
    row max before exp") and still points at ``dt``'s out-of-scale row."""
    ev, bundle = fire("make_continuous", tmp_path, dt=1.0, dt_ms=(29,))
    assert (ev["step"], ev["module"], ev["samples"]) == (3, "", [5]), ev
    rep = nanreplay_json(bundle, "--try", "drop=5")
    o = rep["origin"]
    assert (o["op"], o["samples"], rep["cause"]) == ("aten.linalg_matrix_exp", [5], "overflow"), o
    assert o["source"] == line_of("K = torch.linalg.matrix_exp(self.L[None] * dt[:, None, None])")
    assert "matrix_exp grows as e^(max Re lambda)" in rep["hint"], rep["hint"]
    assert "subtract the row max" not in rep["hint"], rep["hint"]
    assert "sample(s) 5 of args[1]" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_pendulum_at_rest_makes_the_dmd_pseudo_inverse_divide_by_a_zero_singular_value(
        tmp_path):
    """A pendulum released at rest sits on its equilibrium, which the bias-free encoder lifts
    to 0: the snapshot matrix is 0, its singular values are 0, and the rank-3 pseudo-inverse's
    ``/ S_r`` is 0/0 on that record (sample 3 of step 3). The replay names the division, its
    line and the record, says the divisor is svd's singular value of 0 (not just "0 by 0, add
    an eps", which would scale rounding noise by 1 / eps) and advises pinv's truncation by a
    tolerance; dropping the record makes the step finite."""
    ev, bundle = fire("make_latent_dmd", tmp_path, rest=(27,))
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (3, "forward", "", [3]), ev
    rep = nanreplay_json(bundle, "--try", "drop=3")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("", "aten.div", "nan", [3]), o
    assert o["source"] == line_of("A = Ur.transpose(1, 2) @ Y @ Vr / Sr[:, None, :]"), o
    assert rep["cause"] == "invalid", rep["hint"]
    assert "by a singular value of 0 from linalg.svd" in rep["hint"], rep["hint"]
    assert "truncate by a tolerance" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_identity_initialised_operator_puts_eig_backward_at_its_repeated_eigenvalues(tmp_path):
    """K initialised to the identity (start from the identity map): its eigenvalues are all 1,
    and the eigenfunction loss differentiates eig's eigenvectors, whose backward divides by
    the eigenvalues' differences. A backward event at step 0; the replay names
    LinalgEigBackward0 on the eig line, says repeated eigenvalues and advises an
    initialisation without ties."""
    ev, bundle = fire("make_spectral_eye", tmp_path)
    assert (ev["step"], ev["phase"]) == (0, "backward"), ev
    assert "K.weight" in ev["params"], ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["op"]) == ("backward", "LinalgEigBackward0"), o
    assert o["source"] == line_of("lam, V = torch.linalg.eig(self.K.weight)"), o
    assert rep["cause"] == "invalid" and "repeated eigenvalues" in rep["hint"], rep["hint"]
    assert "initialise a learned matrix without ties" in rep["hint"], rep["hint"]


def test_unrecorded_identity_operator_fails_a_step_later_inside_eig(tmp_path):
    """Without the recorder the identity-initialised run's first update (gradient clipping
    of NaN gradients) makes K NaN, and the next step's eig refuses it: an error about eig's
    input a step after the bug, which the event above names where it happened."""
    with pytest.raises(RuntimeError, match="should not contain infs or NaNs"):
        train("make_spectral_eye", tmp_path, record=False)


def test_lorenz_record_simulated_with_an_unstable_euler_step_is_named_as_input(tmp_path):
    """One Lorenz trajectory was simulated with a coarse step (0.5, where forward Euler is
    unstable): its states overflow to inf and NaN in the dataset. The event is the model's
    input at step 3 on that record (sample 2), and the replay says the batch held it."""
    ev, bundle = fire("make_deep_koopman_lorenz", tmp_path, coarse=(26,))
    assert (ev["step"], ev["phase"], ev["samples"]) == (3, "input", [2]), ev
    rep = nanreplay_json(bundle)
    assert (rep["cause"], rep["origin"]["samples"]) == ("input", [2]), rep
    assert "data pipeline" in rep["hint"], rep["hint"]


@pytest.mark.parametrize("make,bf16", [("make_deep_koopman", False), ("make_spectral", False),
                                       ("make_continuous", False), ("make_latent_dmd", False),
                                       ("make_deep_koopman", True)])
def test_healthy_runs_raise_nothing_and_train_the_same(tmp_path, make, bf16):
    """A unit-gain operator (also under bfloat16 autocast: its 11 matrix powers in bf16), eig
    of a random orthogonal K (complex eigenvalues, unit-norm eigenvectors, distinct), a
    generator at every record's own 0.1 s step, DMD of moving pendulums: no event,
    bit-identical weights with and without the recorder."""
    recorded = train(make, tmp_path, bf16=bf16)
    plain = train(make, tmp_path, record=False, bf16=bf16)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name
