"""Gaussian-process regression with the real GPyTorch library: an exact GP trained on its
negative marginal log likelihood, with Adam on the hyper-parameters. GPyTorch's modules
(``ExactGP``, kernels, likelihoods, ``ExactMarginalLogLikelihood``) are called through
``gpytorch.Module.__call__``, which runs ``forward`` without torch's module hooks: recorded as
they are, nothing is seen, and the recorder now says so when it is built. The step recorded
through a torch module holding the model and the MLL (``-mll(model(x), y)``) is checked, and a
``NotPSDError`` that linear_operator's jittered Cholesky raises now writes the step's bundle as
a failed decomposition does."""

from __future__ import annotations

import logging

import gpytorch
import gpytorch_gp_models as M
import pytest
import torch
from bundles import nanreplay_json
from linear_operator.utils.errors import NotPSDError

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
