"""Gaussian-process regression with the real GPyTorch library: an exact GP trained on its
negative marginal log likelihood, with Adam on the hyper-parameters. GPyTorch's modules
(``ExactGP``, kernels, likelihoods, ``ExactMarginalLogLikelihood``) are called through
``gpytorch.Module.__call__``, which runs ``forward`` without torch's module hooks: recorded as
they are, nothing is seen, and the recorder now says so when it is built. The step recorded
through a torch module holding the model and the MLL (``-mll(model(x), y)``) is checked, and a
``NotPSDError`` that linear_operator's jittered Cholesky raises now writes the step's bundle as
a failed decomposition does."""

from __future__ import annotations

import json
import logging

import gpytorch
import gpytorch_gp_models as M
import linear_operator
import pytest
import torch
from bundles import nanreplay_json, source_line
from linear_operator.utils.errors import NotPSDError
from torch.utils.data import DataLoader, TensorDataset

from recorder import FlightRecorder, NonFiniteError
from recorder.bundle import read_bundle

pytestmark = [pytest.mark.usefixtures("in_tests_dir"),
              pytest.mark.filterwarnings("ignore:A not p.d.")]


def _train(step_mod, steps, lr=0.1, rec=None, seen=None):
    opt = torch.optim.Adam(step_mod.parameters(), lr=lr)
    gp = step_mod.model
    x, y = gp.train_inputs[0], gp.train_targets
    step_mod.train()

    def loop():
        for step in range(steps):
            if seen is not None:
                seen.append(step)
            opt.zero_grad()
            step_mod(x, y).backward()
            opt.step()

    if rec is None:
        loop()
    else:
        with FlightRecorder(step_mod, opt, **rec):
            loop()


def test_healthy_exact_gp_has_no_event_and_trains_bit_identically(out_dir):
    plain = M.make_exact_step()
    _train(plain, 15)
    recorded = M.make_exact_step()
    _train(recorded, 15, rec=dict(out_dir=out_dir, factory="gpytorch_gp_models:make_exact_step"))
    assert not list(out_dir.glob("*.nan"))
    for (n, a), (_, b) in zip(plain.named_parameters(), recorded.named_parameters()):
        assert torch.equal(a, b), n


def test_gpytorch_module_recorded_as_is_is_said_to_bypass_hooks(out_dir, caplog):
    """The tutorial's loop with the ExactGP and the MLL given as they are: neither's call runs
    torch's hooks. Before, the only word was after the first update, naming the constraint's
    Softplus and telling the user to call the model itself (which the loop did)."""
    model = M.make_exact()
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="recorder"):
        FlightRecorder(model, opt, loss_fn=mll, out_dir=out_dir)
    text = [r.getMessage() for r in caplog.records]
    assert any(t.startswith("nanreplay: the model ExactGPModel is called through "
                            "gpytorch.module.Module.__call__") and "no step opens" in t
               for t in text), text
    assert any(t.startswith("nanreplay: the loss_fn ExactMarginalLogLikelihood is called")
               and "neither checked nor re-run" in t for t in text), text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="recorder"):
        step_mod = M.make_exact_step()
        FlightRecorder(step_mod, torch.optim.Adam(step_mod.parameters()), out_dir=out_dir)
    assert not [r for r in caplog.records if "__call__" in r.getMessage()]


def test_nan_target_is_an_input_event_on_its_row(out_dir):
    """A missing reading stored as NaN in the targets ExactGP conditions on: step 0, named as
    the input ``y`` on sample 5."""
    with pytest.raises(NonFiniteError) as info:
        _train(M.make_exact_step(nan_target=5), 10,
               rec=dict(out_dir=out_dir, factory="gpytorch_gp_models:make_exact_step",
                        factory_kwargs={"nan_target": 5}))
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], rep["cause"], o["samples"]) == \
        (0, "input", "input", [5]), rep
    assert "args[1]" in o["tensor"] or "y" in str(o), o


@pytest.fixture
def gpytorch_cholesky_tries():
    """linear_operator's default of 3 Cholesky tries (jitter up to 1e-4 in float32), which
    importing BoTorch (another test file, same worker) raises to 6 for the whole process."""
    with linear_operator.settings.cholesky_max_tries(3):
        yield


@pytest.mark.usefixtures("gpytorch_cholesky_tries")
def test_not_psd_error_of_jittered_cholesky_writes_the_bundle(out_dir):
    """Duplicated training points, the noise constraint lowered to 1e-10 and an outputscale
    of 1e3: the kernel matrix is singular past the 1e-4 jitter linear_operator's
    ``psd_safe_cholesky`` tries, and it raises ``NotPSDError`` (a RuntimeError of its own).
    Before, that passed through unrecorded; now it is the step's ``linalg`` event, the error
    reaching the loop unchanged with the summary as a note."""
    kw = dict(duplicates=6, noise_floor=1e-10, outputscale=1e3, lengthscale=0.5)
    steps: list[int] = []
    with pytest.raises(NotPSDError) as info:
        _train(M.make_exact_step(**kw), 10, seen=steps,
               rec=dict(out_dir=out_dir, factory="gpytorch_gp_models:make_exact_step",
                        factory_kwargs=kw))
    bundles = sorted(out_dir.glob("*.nan"))
    assert len(bundles) == 1 and steps == [0], (bundles, steps)
    notes = getattr(info.value, "__notes__", [])
    assert any(n.startswith("nanreplay: a matrix decomposition failed at step 0 (NotPSDError: "
                            "Matrix not positive definite") for n in notes), notes
    meta = read_bundle(bundles[0])[0]
    assert meta["event"]["reason"] == "linalg", meta["event"]
    # the replay: before, "replay failed (NotPSDError: ...)"; linear_operator reads cholesky_ex's
    # info itself, no torch check op raises, so the first failing call since the last success
    # is the op; float64 makes it positive-definite (by the 2e-10 noise alone)
    rep = nanreplay_json(bundles[0])
    o = rep["origin"]
    assert (rep["event"]["step"], rep["reproduced"], o["phase"], o["module"], o["op"],
            rep["cause"], o["samples"]) == \
        (0, True, "forward", "", "aten.linalg_cholesky_ex", "precision", []), rep
    assert o["error"].startswith("NotPSDError: Matrix not positive definite"), o
    assert "ridge the code adds to its diagonal" in rep["hint"] and "2e-10 here" in rep["hint"] \
        and "GreaterThan(1e-4)" in rep["hint"], rep["hint"]


def test_user_kernel_sqrt_distance_is_a_backward_nan_at_sqrt(out_dir):
    """A hand-written Laplace kernel takes the distance as ``sqrt`` of summed squares: finite
    forward, an infinite derivative on the diagonal (each point's distance to itself), NaN in
    the lengthscale's gradient at step 0. The replay names SqrtBackward0 on the user's line."""
    with pytest.raises(NonFiniteError) as info:
        _train(M.make_laplace_step(), 5,
               rec=dict(out_dir=out_dir, factory="gpytorch_gp_models:make_laplace_step"))
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["module"], o["op"], rep["cause"]) == \
        (0, "backward", "", "SqrtBackward0", "invalid"), rep
    assert o["source"] == source_line("gpytorch_gp_models.py", "dist = diff.pow(2)"), o
    assert "vector_norm" in rep["hint"], rep["hint"]


def test_svgp_minibatch_with_nan_target_names_its_row(out_dir):
    """An SVGP trained on mini-batches of a DataLoader with the VariationalELBO: target 70 is
    NaN, so batch 2 (rows 64-95) is the input event, on its row 6."""
    x, y = M.svgp_data(nan_rows=(70,))
    step_mod = M.make_svgp_step(n_data=len(y))
    opt = torch.optim.Adam(step_mod.parameters(), lr=0.01)
    loader = DataLoader(TensorDataset(x, y), batch_size=32)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(step_mod, opt, out_dir=out_dir,
                            factory="gpytorch_gp_models:make_svgp_step",
                            factory_kwargs={"n_data": len(y)}):
            for xb, yb in loader:
                opt.zero_grad()
                step_mod(xb, yb).backward()
                opt.step()
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], rep["cause"], o["samples"]) == \
        (2, "input", "input", [6]), rep


def test_lengthscale_set_to_zero_names_the_users_line(out_dir):
    """``lengthscale = 0.0`` through GPyTorch's setter stores the raw parameter as the inverse
    softplus of 0, ``log(expm1(0)) = -inf``: a weights event at step 0 (the user's loop gets
    linear_operator's NanError, with the summary as a note). Before, the hint named only
    gpytorch's transforms.py and said to clamp a distance or a count; now it names the line of
    the user's that set the value, and says to give it inside the constraint's range."""
    with pytest.raises(RuntimeError) as info:
        _train(M.make_exact_step(lengthscale=0.0), 5,
               rec=dict(out_dir=out_dir, factory="gpytorch_gp_models:make_exact_step",
                        factory_kwargs={"lengthscale": 0.0}))
    assert type(info.value).__name__ == "NanError", info.value
    bundle, = out_dir.glob("*.nan")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], rep["cause"]) == (0, "weights", "weights"), rep
    assert "model.covar_module.base_kernel.raw_lengthscale" in json.dumps(o), o
    line = source_line("gpytorch_gp_models.py", "base_kernel.lengthscale = lengthscale")
    assert f"called from {line}" in rep["hint"] and "constraint's range (> 0)" in rep["hint"], \
        rep["hint"]


def test_deep_kernel_on_an_infinite_reading_is_an_input_event(out_dir):
    """A deep-kernel GP (an MLP feature extractor before the RBF kernel) whose training inputs
    hold +inf in row 3 (a sensor's overflow value). The MLP's first Linear makes NaN of it and
    linear_operator's Cholesky raises ``NanError`` before the recorded call returns. Before, the
    event was ``forward`` in ``model.feature_extractor.0`` (cause ``invalid``: "find the op
    that made the first infinity"), as the unfinished root's +inf was read as a possible mask;
    now an infinity that is no additive mask is the batch's, as for a root that returned."""
    with pytest.raises(RuntimeError) as info:
        _train(M.make_dkl_step(blank_rows=[3]), 5,
               rec=dict(out_dir=out_dir, factory="gpytorch_gp_models:make_dkl_step",
                        factory_kwargs={"blank_rows": [3]}))
    assert type(info.value).__name__ == "NanError", info.value
    bundle, = out_dir.glob("*.nan")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["event"]["step"], rep["event"]["phase"], o["phase"], rep["cause"],
            o["samples"]) == (0, "input", "input", "input", [3]), rep
    assert o["tensor"] == "args[0]", o


def test_lengthscale_driven_to_zero_overflows_the_squared_distance(out_dir):
    """Adam at lr=30 on targets in raw units drives the lengthscale to ~1e-21 by step 2: the
    RBF kernel's ``(x / lengthscale).pow(2)`` overflows float32 (+inf), and linear_operator's
    Cholesky raises NanError on the kernel matrix. The replay names the overflow, not the
    Cholesky: aten.pow, every row, with the Cholesky's error as a note."""
    with pytest.raises(RuntimeError) as info:
        _train(M.make_exp_scale_step(), 10, lr=30.0,
               rec=dict(out_dir=out_dir, factory="gpytorch_gp_models:make_exp_scale_step"))
    assert type(info.value).__name__ == "NanError", info.value
    bundle, = out_dir.glob("*.nan")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["event"]["step"], rep["reproduced"], o["phase"], o["module"], o["op"],
            rep["cause"], o["samples"]) == \
        (2, True, "forward", "", "aten.pow", "overflow", list(range(24))), rep
