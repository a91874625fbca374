"""Bayesian optimisation with BoTorch 0.18.1: a ``SingleTaskGP`` with ``Normalize`` and
``Standardize`` fitted by ``fit_gpytorch_mll`` (scipy's L-BFGS-B through a closure over the
recorded ``GPStep``, no torch optimizer) or by a hand-written Adam loop, and a deep-kernel GP
trained with Adam. GPyTorch's modules bypass torch's hooks, so the recorded module is the
``-mll(model(x), y)`` step."""

from __future__ import annotations

import logging

import botorch_bo_models as M
import pytest
import torch
from botorch.fit import fit_gpytorch_mll
from botorch.optim.closures import ForwardBackwardClosure
from bundles import nanreplay_json

from recorder import FlightRecorder, NonFiniteError

pytestmark = [pytest.mark.usefixtures("in_tests_dir"),
              pytest.mark.filterwarnings("ignore::botorch.exceptions.warnings.InputDataWarning"),
              pytest.mark.filterwarnings("ignore:A not p.d.")]

STGP = "botorch_bo_models:make_stgp"


def _fit(step, rec=None):
    """``fit_gpytorch_mll`` with the closure over the recorded step (scipy's L-BFGS-B)."""
    if rec is None:
        return fit_gpytorch_mll(step.mll, closure=M.step_closure(step))
    with FlightRecorder(step, **rec) as recorder:
        fit_gpytorch_mll(step.mll, closure=M.step_closure(step))
    return recorder.step  # (the closure evaluations it recorded)


def _adam(step, steps, lr, rec):
    opt = torch.optim.Adam(step.parameters(), lr=lr)
    x, y = M.train_batch(step)
    step.train()

    def loop():
        for _ in range(steps):
            opt.zero_grad()
            step(x, y).backward()
            opt.step()

    if rec is None:
        return loop()
    with FlightRecorder(step, opt, **rec):
        loop()


def test_healthy_fit_has_no_event_and_fits_bit_identically(out_dir):
    plain, recorded = M.make_stgp(), M.make_stgp()
    _fit(plain)
    assert _fit(recorded, rec=dict(out_dir=out_dir, factory=STGP)) > 10
    assert not list(out_dir.glob("*.nan"))
    for (n, a), (_, b) in zip(plain.named_parameters(), recorded.named_parameters()):
        assert torch.equal(a, b), n


def test_healthy_bo_loop_and_adam_fits_have_no_event(out_dir):
    """Three rounds of BO (LogEI, qLogNEI, UCB through optimize_acqf, the GP refitted each round
    under its own recorder) pick the same candidates as without it; a MixedSingleTaskGP fitted
    with fit_gpytorch_mll and a DKL model trained with Adam raise no event and end on the same
    weights."""
    def record(step):
        return FlightRecorder(step, out_dir=out_dir, factory=STGP)

    plain_x, _ = M.bo_loop()
    recorded_x, _ = M.bo_loop(record=record)
    assert torch.equal(plain_x, recorded_x)
    runs = ((M.make_mixed, _fit), (M.make_dkl, lambda step, rec: _adam(step, 10, 0.05, rec)))
    for make, fit in runs:
        plain, recorded = make(), make()
        fit(plain, None)
        fit(recorded, dict(out_dir=out_dir))
        for (n, a), (_, b) in zip(plain.named_parameters(), recorded.named_parameters()):
            assert torch.equal(a, b), n
    assert not list(out_dir.glob("*.nan"))


def test_model_and_mll_recorded_as_given_say_how_fit_gpytorch_mll_is_recorded(out_dir, caplog):
    """The first try: ``FlightRecorder(model, loss_fn=mll)`` with no optimizer around
    ``fit_gpytorch_mll(mll)``. GPyTorch's ``__call__`` runs no torch hook, and the fit calls the
    MLL itself: nothing is recorded. Before, the warning said to record a wrapper module "with
    the optimizer over its parameters", which a scipy fit has not; now it says to give
    ``fit_gpytorch_mll`` a closure calling that module."""
    model = M.make_stgp().model
    mll = M.ExactMarginalLogLikelihood(model.likelihood, model)
    with caplog.at_level(logging.WARNING, logger="recorder"):
        with FlightRecorder(model, loss_fn=mll, out_dir=out_dir) as rec:
            fit_gpytorch_mll(mll)
    assert rec.step == 0 and not list(out_dir.glob("*.nan"))
    text = [r.getMessage() for r in caplog.records]
    assert any(t.startswith("nanreplay: the model SingleTaskGP is called through gpytorch")
               and "fit_gpytorch_mll(mll, closure=ForwardBackwardClosure(forward=lambda: "
               "step(x, y)" in t for t in text), text


def test_collapsed_dkl_features_are_a_0d_divisor(out_dir):
    """A DKL model whose hidden layers start with a bias of -10 (every ReLU dead): the feature
    extractor returns one value for every row, and ``ScaleToBounds``'s ``1.9 / (max - min)``
    is 1/0. Before, the hint said to skip the rows where the divisor is 0 (there are none: the
    divisor is 0-d); now it is named as one value for every element, a statistic over the
    batch whose values were all equal."""
    kw = {"dead_bias": -10.0, "d_out": 1}
    with pytest.raises(RuntimeError) as info:
        _adam(M.make_dkl(**kw), 5, 0.01,
              dict(out_dir=out_dir, factory="botorch_bo_models:make_dkl", factory_kwargs=kw))
    assert type(info.value).__name__ == "NanError", info.value
    bundle, = out_dir.glob("*.nan")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["module"], o["op"], rep["cause"],
            o["samples"]) == (0, "forward", "model.scale_to_bounds", "aten.reciprocal",
                              "invalid", list(range(32))), rep
    assert "in a 0-d divisor" in rep["hint"] and "every value equal" in rep["hint"] \
        and "skip the rows" not in rep["hint"], rep["hint"]


def test_normalize_bounds_of_zero_width_name_the_coefficient(out_dir):
    """``Normalize`` given bounds of zero width in a pinned input (0.5 to 0.5) that the past
    trials varied: ``(X - offset) / coefficient`` is x/0 in that column, and linear_operator's
    Cholesky raises NanError (a ``linalg`` event). Before, the hint called the divisor a
    statistic over the batch (a dead ReLU unit, Barlow Twins' eps); now it names the buffer
    ``model.input_transform._coefficient`` and its zero entry."""
    kw = {"bounds": [[0, 0, 0.5], [10, 5, 0.5]]}
    with pytest.raises(RuntimeError) as info:
        _adam(M.make_stgp(**kw), 5, 0.05, dict(out_dir=out_dir, factory=STGP, factory_kwargs=kw))
    assert type(info.value).__name__ == "NanError", info.value
    bundle, = out_dir.glob("*.nan")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["event"]["step"], rep["event"]["phase"], o["op"], rep["cause"],
            o["samples"]) == (0, "forward", "aten.div", "invalid", list(range(12))), rep
    assert any(p.startswith("aten.linalg_cholesky_ex raised on the +inf that aten.div made")
               for p in rep["problems"]), rep["problems"]
    assert "the buffer model.input_transform._coefficient" in rep["hint"] \
        and "entry (0, 2)" in rep["hint"] and "statistic over the batch" not in rep["hint"], \
        rep["hint"]


def test_outcomes_in_raw_units_overflow_float32(out_dir):
    """Outcomes of scale 1e25 without ``Standardize``, in float32: the MLL's squared
    residuals overflow at the first closure evaluation of ``fit_gpytorch_mll``. Before, the
    hint said to subtract the row max before exp or bound a learned exponent; now it names the
    targets' scale and the outcome transform."""
    kw = {"scale": 1e25, "standardize": False, "dtype": "float32"}
    with pytest.raises(NonFiniteError) as info:
        _fit(M.make_stgp(**kw), rec=dict(out_dir=out_dir, factory=STGP, factory_kwargs=kw))
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["module"], o["op"], rep["cause"],
            o["samples"]) == (0, "forward", "", "aten.pow", "overflow", list(range(12))), rep
    assert "the batch's args[1], which holds values up to 5.21e+25" in rep["hint"] \
        and "Standardize(m=1)" in rep["hint"] and "row max" not in rep["hint"], rep["hint"]


def test_infinite_observation_is_an_input_event_on_its_row(out_dir):
    """An evaluation that returned +inf (a failed simulation's sentinel) kept without
    ``Standardize``: BoTorch's own check refuses NaN only, so the fit's first closure
    evaluation is an input event on the targets' row 5."""
    kw = {"standardize": False, "bad_obs": {"5": "inf"}}
    with pytest.raises(NonFiniteError) as info:
        _fit(M.make_stgp(**kw), rec=dict(out_dir=out_dir, factory=STGP, factory_kwargs=kw))
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], rep["cause"], o["samples"]) == \
        (0, "input", "input", [5]), rep


class _Diverged(Exception):
    """Ends the plain fit at its first evaluation that returned a non-finite gradient (not a
    RuntimeError: BoTorch's closure and fit_gpytorch_mll's fallback let it through)."""


def _first_nan_gradient(step) -> tuple[int, list[str | None], float]:
    """The oracle for a fit that diverges: ``fit_gpytorch_mll`` run plainly (no recorder)
    through a closure like ``M.step_closure``'s that counts its evaluations (a step each, as
    the recorder without an optimizer counts root forwards). Returns the first evaluation
    whose gradient was non-finite, for each evaluation before it the name of the exception its
    forward raised (None where it returned), and the smallest lengthscale at that
    evaluation."""
    x, y = M.train_batch(step)
    raised: list[str | None] = []

    def forward():
        raised.append("?")  # (until the forward returns)
        try:
            loss = step(x, y)
        except Exception as e:
            raised[-1] = type(e).__name__
            raise
        raised[-1] = None
        return loss

    inner = ForwardBackwardClosure(forward=forward, parameters={
        n: p for n, p in step.mll.named_parameters() if p.requires_grad})

    def closure(**kw):
        loss, grads = inner(**kw)
        if not all(bool(torch.isfinite(g).all()) for g in grads if g is not None):
            # (read here: the fit puts the initial values back when it ends on an exception)
            low = step.model.covar_module.lengthscale.detach().abs().min()
            raise _Diverged(len(raised) - 1, float(low))
        return loss, grads

    with pytest.raises(_Diverged) as stop:
        fit_gpytorch_mll(step.mll, closure=closure)
    at, low = stop.value.args
    return at, raised[:at], low


def test_lengthscale_prior_toward_zero_names_the_vanished_divisor(out_dir):
    """A Gamma(0.2, 50) lengthscale prior, whose density grows without bound at 0: L-BFGS-B
    drives the raw lengthscale to about -355 (a lengthscale near 5e-155). Evaluations whose
    Cholesky failed raise NanError inside the model and BoTorch's closure catches them (a NaN
    loss for scipy); the first evaluation that returned with a NaN gradient is the event:
    ``DivBackward0`` of GPyTorch's ``x.div(lengthscale)``, whose ``-x / d²`` overflows. Before,
    the hint said to make the op's input safe (torch.where) or add an eps, and the note read
    the caught forwards as a recurrent cell's calls; now it names the learned divisor and its
    value, and the note the forwards that raised, from the first in the history. The step, the
    value and the forwards that raised follow the trajectory, which the CPU's rounding moves
    (step 273 on one CPU, 503 on another): a plain fit counting its evaluations gives them."""
    kw = {"ls_prior": [0.2, 50.0]}
    at, raised, low = _first_nan_gradient(M.make_stgp(**kw))
    history = 64  # (the recorder's ring: the event's step and the 63 before it)
    window = range(max(0, at - (history - 1)), at)
    failed = [s for s in window if raised[s] is not None]
    assert failed and {raised[s] for s in failed} == {"NanError"}, raised
    with pytest.raises(NonFiniteError) as info:
        _fit(M.make_stgp(**kw), rec=dict(out_dir=out_dir, factory=STGP, factory_kwargs=kw,
                                         history=history))
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["module"], o["op"], o["param"],
            rep["cause"]) == (at, "backward", "", "DivBackward0",
                              "model.covar_module.raw_lengthscale", "invalid"), rep
    assert low * low < torch.finfo(torch.float64).tiny < low, low
    assert "a learned value (model.covar_module.raw_lengthscale) that is not 0 but as small " \
        f"as {low:.3g}," in rep["hint"] and "GreaterThan(1e-4)" in rep["hint"] \
        and "torch.where" not in rep["hint"], rep["hint"]
    assert any(f"{len(failed)} of the {len(window)} steps before this one, the earliest "
               f"recorded step {failed[0]}, ended without the model's forward returning" in p
               for p in rep["problems"]), rep["problems"]


def test_mixed_gp_with_adam_crosses_the_unenforced_noise_bound(out_dir):
    """A MixedSingleTaskGP trained by a hand-written Adam loop (lr=0.05): BoTorch's
    likelihood declares its noise ``GreaterThan(1e-4, transform=None)``, a bound only
    fit_gpytorch_mll's L-BFGS-B is given, so the first step takes the noise itself to -0.043
    and the next Cholesky raises NotPSDError. The hint names the parameter (as before) and now
    also the constraint that no transform enforces, and fitting with fit_gpytorch_mll."""
    with pytest.raises(RuntimeError) as info:
        _adam(M.make_mixed(), 5, 0.05,
              dict(out_dir=out_dir, factory="botorch_bo_models:make_mixed"))
    assert type(info.value).__name__ == "NotPSDError", info.value
    bundle, = out_dir.glob("*.nan")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["module"], o["op"], rep["cause"]) == \
        (1, "forward", "", "aten.linalg_cholesky_ex", "invalid"), rep
    assert "model.likelihood.noise_covar.raw_noise = -0.0433, below 0" in rep["hint"] \
        and "raw_noise_constraint (GreaterThan, lower bound 0.0001) has no transform" \
        in rep["hint"] and "fit with fit_gpytorch_mll" in rep["hint"], rep["hint"]
