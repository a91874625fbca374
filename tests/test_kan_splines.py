"""Kolmogorov-Arnold networks end to end (``kan_splines_models``): efficient-kan's B-spline
layers with grid updates from the batch's quantiles inside the forward (knots written in place,
coefficients refitted by ``torch.linalg.lstsq``), pykan's L1 + entropy regulariser over the
activations it keeps, LBFGS and Adam, and ChebyKAN's ``cos(k * acos(tanh(x)))``. Each planted
bug is trained into as a user would, then ``nanreplay --json`` is checked claim by claim;
healthy runs raise nothing and end bit-identical to runs without the recorder."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import kan_splines_models as M
import pytest
import torch
from bundles import line_number, nanreplay_json, source_line
from torch import nn

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

MODELS = "kan_splines_models.py"
K = 3  # the step every planted bug fires at (a grid update's step in the efficient-kan loop)


def regression(step: int, n: int = 32, flag: bool = False, shift: float = 0.0,
               outlier: float = 1.0, absent: bool = False):
    """A batch of ``y = sin(3 x0) + x1^2`` on [-1, 1]^4; ``flag``: feature 2 a 0/1 flag
    (mostly 0); at step K, ``shift`` moves the whole batch (un-normalised data) and
    ``outlier`` scales sample 5; ``absent``: the flag is set in no sample of that batch."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.rand(n, M.D_IN, generator=g) * 2 - 1
    if flag:
        x[:, 2] = (x[:, 2] > 0.5).float() * (not (absent and step == K))
    y = torch.sin(3 * x[:, :1]) + x[:, 1:2] ** 2
    if step == K:
        x = x + shift
        x[5] = x[5] * outlier
    return x, y


def same_state(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def report(rep: dict) -> str:
    return json.dumps({k: rep.get(k) for k in ("event", "origin", "cause", "hint", "problems")},
                      indent=1)


def efficient_kan(factory: str, out_dir: Path | None, steps: int = 6, flag: bool = False,
                  shift: float = 0.0, absent: bool = False) -> nn.Module:
    """efficient-kan's loop: Adam, a grid update inside the forward every K steps, the
    regularisation loss added in the loop, clipping and a scheduler."""
    model = getattr(M, factory)()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
    crit = nn.MSELoss()
    rec = contextlib.nullcontext() if out_dir is None else FlightRecorder(
        model, opt, loss_fn=crit, out_dir=out_dir, factory=f"kan_splines_models:{factory}")
    with rec:
        for step in range(steps):
            x, y = regression(step, flag=flag, shift=shift, absent=absent)
            opt.zero_grad()
            out = model(x, update_grid=step % K == 0 and step > 0)
            loss = crit(out, y) + 1e-4 * model.regularization_loss()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
    return model


def test_grid_updates_in_place_raise_nothing_and_change_nothing(tmp_path):
    """Grid updates write the knot buffer and the spline coefficients in place inside the
    forward (under no_grad): no event, and no corruption claimed. The weights, knots
    included, end bit-identical to the same run without the recorder."""
    recorded = efficient_kan("make_kan", tmp_path, steps=8)
    plain = efficient_kan("make_kan", None, steps=8)
    assert same_state(recorded, plain)
    assert not list(tmp_path.glob("*.nan"))
    assert not torch.equal(recorded.layers[0].grid, M.make_kan().layers[0].grid)  # (updated)


def test_a_refit_in_the_forward_is_no_nondeterminism(tmp_path):
    """The grid update of step K refits on a batch shifted to [2, 4] whose feature 2 takes
    two values: some edges' coefficients come out all 0, and efficient-kan's entropy term,
    added in the loop, is 0 * log 0 = NaN; the clip spreads it to every gradient. That term
    is the loop's, so the replay cannot re-run it; but its two re-runs must agree: the
    forward's refit through ``.data`` is put back before the second, and said."""
    with pytest.raises(NonFiniteError) as info:
        efficient_kan("make_kan", tmp_path, flag=True, shift=3.0)
    assert (info.value.event["step"], info.value.event["phase"]) == (K, "backward")
    rep = nanreplay_json(info.value.bundle_path, code=None)
    problems = " ".join(rep["problems"])
    assert "two re-runs of the step disagree" not in problems, report(rep)
    assert "writes its trained parameters (layers.0.spline_weight, layers.1.spline_weight) " \
        "itself, through .data" in problems, report(rep)
    assert "a loss term on the weights themselves added in the loop" in rep["hint"], report(rep)


def pykan_lbfgs(out_dir: Path | None, steps: int = 3) -> nn.Module:
    """pykan's fit: LBFGS with a strong-Wolfe line search over a closure whose loss adds the
    regulariser (given the model, as the recorder's loss_fn)."""
    model = M.make_pykan()
    opt = torch.optim.LBFGS(model.parameters(), lr=1, history_size=10, max_iter=3,
                            line_search_fn="strong_wolfe")
    with (contextlib.nullcontext() if out_dir is None else FlightRecorder(
            model, opt, loss_fn=M.pykan_loss, out_dir=out_dir,
            factory="kan_splines_models:make_pykan")) as rec:
        loss_fn = M.pykan_loss if rec is None else rec.loss_fn
        for step in range(steps):
            x, y = regression(step, n=16)

            def closure(x=x, y=y):
                opt.zero_grad()
                loss = loss_fn(model(x), y, model)
                loss.backward()
                return loss
            opt.step(closure)
    return model


def test_pykan_lbfgs_with_its_regulariser_in_the_loss_raises_nothing(tmp_path):
    recorded, plain = pykan_lbfgs(tmp_path), pykan_lbfgs(None)
    assert same_state(recorded, plain)
    assert not list(tmp_path.glob("*.nan"))


def test_pykan_batch_outside_the_grid_raises_nothing(tmp_path):
    """An un-normalised batch (shifted by 10) outside every grid: its B-spline bases are 0
    (extrapolation), the SiLU branch alone carries it; no event, the same weights."""
    def run(out_dir):
        model = M.make_pykan()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        with (contextlib.nullcontext() if out_dir is None else FlightRecorder(
                model, opt, loss_fn=M.pykan_loss, out_dir=out_dir,
                factory="kan_splines_models:make_pykan")) as rec:
            for step in range(5):
                x, y = regression(step, n=16, shift=10.0)
                opt.zero_grad()
                (rec.loss_fn if rec else M.pykan_loss)(model(x), y, model).backward()
                opt.step()
        return model
    assert same_state(run(tmp_path), run(None))
    assert not list(tmp_path.glob("*.nan"))


def test_repeated_knots_after_an_adaptive_grid_update_name_the_knot_buffer(tmp_path):
    """``grid_eps=0`` puts the knots at the batch's quantiles only; feature 2 is a 0/1 flag,
    so after the update at step K its knots repeat and the Cox-de Boor recursion divides by
    their difference, 0: 0/0 for every sample. The NaN bases then reach lstsq, which MKL
    refuses as an "illegal value" (a RuntimeError, not a LinAlgError): the recorder takes it
    as a failed decomposition and writes the step; the loop's own error goes on. The replay
    names the division on the recursion's line, every sample, ``invalid``, and says the
    divisor is made of the knot buffer (row 2 repeated), not of degenerate records."""
    with pytest.raises(RuntimeError, match="illegal value") as info:
        efficient_kan("make_adaptive_kan", tmp_path, flag=True)
    assert not isinstance(info.value, NonFiniteError)
    bundles = list(tmp_path.glob("*.nan"))
    assert len(bundles) == 1 and any(str(bundles[0]) in n for n in info.value.__notes__)
    rep = nanreplay_json(bundles[0])
    assert rep["event"]["detail"].startswith(
        "RuntimeError: torch.linalg.lstsq: (Batch element 2): Argument 4 has illegal value "
        "(LAPACK's refusal of a NaN or Inf in the matrix)"), rep["event"]["detail"]
    o = rep["origin"]
    assert (rep["event"]["step"], rep["reproduced"], o["phase"], o["op"], rep["cause"]) == (
        K, True, "forward", "aten.div", "invalid"), report(rep)
    assert o["source"] == source_line(MODELS, "(x - grid[:, : -(k + 1)]) / (grid"), o["source"]
    assert o["all_samples"] and o["samples"] == list(range(32)), report(rep)
    hint = rep["hint"]
    assert "buffer layers.0.grid" in hint and "row 2 of it holds equal entries" in hint, hint
    assert "degenerate" not in hint and "records" not in hint.split("no sample's record")[1]


def test_gels_refit_over_bases_no_point_reaches_is_rank_deficient_not_use_lstsq(tmp_path):
    """The refit with ``gels`` (QR: the driver CUDA has) after a grid update on a batch where
    the flag feature is 0 in every sample: the spans around 0 hold every point, the bases
    outside them are exactly 0 (whole columns of the refit's matrix), and lstsq raises
    LinAlgError. The replay names lstsq on its line, ``invalid`` (rank-deficient in float64
    too), and advises another driver, pinv or a ridge, not lstsq itself. (A batch holding
    both flag values gave a rank-2 matrix without zero columns: whether QR's diagonal came
    out exactly 0 there depended on the CPU's rounding, and gels raised on one machine only.)"""
    with pytest.raises(torch.linalg.LinAlgError):
        efficient_kan("make_gels_kan", tmp_path, flag=True, absent=True)
    rep = nanreplay_json(next(tmp_path.glob("*.nan")))
    o = rep["origin"]
    assert (rep["event"]["step"], o["op"], rep["cause"]) == (
        K, "aten.linalg_lstsq", "invalid"), report(rep)
    assert o["source"] == source_line(MODELS, "torch.linalg.lstsq(A, B"), o["source"]
    hint = rep["hint"]
    assert "rank-deficient" in hint and "driver='gelsd'" in hint and "pinv" in hint, hint
    assert "use torch.linalg.lstsq" not in hint, hint


def pykan_adam(out_dir: Path, in_loss: bool) -> NonFiniteError:
    """pykan with ``base_fun='zero'`` (splines only), Adam; at step K the batch comes
    un-normalised (shifted by 10): every input is outside the first layer's grid, its
    activations are all 0, and the regulariser's shares ``acts / acts.sum()`` are 0/0.
    ``in_loss``: the regulariser inside the recorder's loss_fn, else added in the loop."""
    model = M.make_spline_only_pykan()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    crit = M.pykan_loss if in_loss else nn.MSELoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="kan_splines_models:make_spline_only_pykan") as rec:
            for step in range(6):
                x, y = regression(step, n=16, shift=10.0)
                opt.zero_grad()
                out = model(x)
                loss = rec.loss_fn(out, y, model) if in_loss else \
                    crit(out, y) + 1e-2 * M.pykan_reg(model)
                loss.backward()
                opt.step()
    assert info.value.event["step"] == K
    return info.value


def test_entropy_of_an_all_zero_layer_in_the_loss_names_the_share(tmp_path):
    """The regulariser inside loss_fn (as the replay's hint for a loop term advises): a loss
    event; the re-run (whose backward of a loss given the model takes its direct path through
    the forward's nodes, then the output's) names the division of the shares, ``invalid``."""
    err = pykan_adam(tmp_path, in_loss=True)
    assert err.event["phase"] == "loss"
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], o["phase"], o["module"], o["op"], rep["cause"]) == (
        True, "loss", "<loss>", "aten.div", "invalid"), report(rep)
    assert o["source"] == source_line(MODELS, "p = acts / l1"), o["source"]


def test_entropy_of_an_all_zero_layer_added_in_the_loop_names_the_kept_activations(tmp_path):
    """The regulariser added in the loop: a backward event in the first layer's spline
    weights. The replay cannot re-run that term; it must not say the loop wrote the
    gradients by hand, but name the activations the forward keeps (l0.acts_scale, all 0)."""
    err = pykan_adam(tmp_path, in_loss=False)
    assert err.event["phase"] == "backward"
    assert set(err.event["params"]) == {"l0.kan.spline_weight", "l0.kan.spline_scaler"}
    rep = nanreplay_json(err.bundle_path, code=None)
    assert rep["cause"] == "not_reproduced", report(rep)
    hint = rep["hint"]
    assert "(l0.acts_scale, l1.acts_scale)" in hint, hint
    assert "l0.acts_scale is 0 throughout" in hint and "inside loss_fn" in hint, hint
    assert "written by the loop's own code" not in hint, hint


@pytest.mark.parametrize("outlier, cause", [(130.0, "precision"), (300.0, "invalid")])
def test_chebykan_tanh_saturated_to_one_is_acos_backward(tmp_path, outlier, cause):
    """ChebyKAN after a linear stem: sample 5 of step K is an outlier, its stem outputs reach
    past 9, where float32's tanh rounds to exactly 1 (float64's below 19 does not; beyond it,
    it does too), and acos's derivative there is infinite:
    NaN gradients into the stem. AcosBackward0 in c0 on the ``acos`` line, sample 5;
    ``precision`` where float64's tanh stays below 1 (~17), ``invalid`` where it too is 1."""
    model = M.make_cheby()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    crit = nn.MSELoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="kan_splines_models:make_cheby"):
            for step in range(6):
                x, y = regression(step, n=16, outlier=outlier)
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (K, "backward")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["samples"], rep["cause"]) == (
        True, "c0", "AcosBackward0", [5], cause), report(rep)
    assert o["source"] == f"{MODELS}:{line_number(MODELS, 'x = x.acos()')}", o["source"]
    assert "+-1, the edge of acos's domain" in rep["hint"], rep["hint"]


def test_chebykan_healthy_run_is_silent_and_identical(tmp_path):
    def run(out_dir):
        model = M.make_cheby()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        crit = nn.MSELoss()
        with (contextlib.nullcontext() if out_dir is None else FlightRecorder(
                model, opt, loss_fn=crit, out_dir=out_dir,
                factory="kan_splines_models:make_cheby")):
            for step in range(6):
                x, y = regression(step, n=16)
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
        return model
    assert same_state(run(tmp_path), run(None))
    assert not list(tmp_path.glob("*.nan"))


def test_entropy_of_an_all_zero_layer_under_lbfgs_is_the_closure_evaluation(tmp_path):
    """pykan's LBFGS fit: each closure evaluation is a step of the recorder's. The shifted
    batch of step K (the K-th ``opt.step(closure)``) makes the first layer's activations all
    0 at its first evaluation; the bundle's step is that evaluation's, re-run, the shares'
    division named."""
    model = M.make_spline_only_pykan()
    opt = torch.optim.LBFGS(model.parameters(), lr=1, history_size=10, max_iter=3,
                            line_search_fn="strong_wolfe")
    evaluations = []
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=M.pykan_loss, out_dir=tmp_path,
                            factory="kan_splines_models:make_spline_only_pykan") as rec:
            for step in range(6):
                x, y = regression(step, n=16, shift=10.0)

                def closure(x=x, y=y, step=step):
                    evaluations.append(step)
                    opt.zero_grad()
                    loss = rec.loss_fn(model(x), y, model)
                    loss.backward()
                    return loss
                opt.step(closure)
    assert evaluations[-1] == K and evaluations.count(K) == 1
    assert (info.value.event["step"], info.value.event["phase"]) == (len(evaluations) - 1, "loss")
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], o["op"], rep["cause"]) == (True, "aten.div", "invalid"), report(rep)
    assert o["source"] == source_line(MODELS, "p = acts / l1"), o["source"]


def test_only_a_difference_of_a_buffers_entries_is_named_as_the_divisor():
    """The knot hint's trigger: a divisor made by subtracting one buffer's entries (knot
    spans), not one that merely is a buffer (a running variance of 0) or mixes in the
    batch."""
    from replay.param_names import ParamNames

    m = nn.Module()
    m.register_buffer("grid", torch.tensor([[0.0, 0.0, 1.0, 2.0]]))
    m.register_buffer("var", torch.zeros(3))
    names = ParamNames()
    names.index(m.named_parameters(), m.named_buffers())
    x = torch.rand(5, 1, 3)
    hi, lo = m.grid[:, 1:], m.grid[:, :-1]
    span = hi - lo
    names.track("sub", [hi, lo], [span])
    names.among([x - lo, span], "div", hit=True)
    assert names.hit_divisor_buffer == "grid"
    names.among([x, m.var], "div", hit=True)
    assert names.hit_divisor_buffer is None
    mixed = span + x
    names.track("add", [span, x], [mixed])
    names.among([x, mixed], "div", hit=True)
    assert names.hit_divisor_buffer is None


@pytest.mark.parametrize("how", ["pykan", "no_grad"])
def test_grid_updates_between_steps_raise_nothing_and_change_nothing(tmp_path, how, caplog):
    """The grid updated between steps: pykan's ``update_grid_from_samples`` (the layers
    called one by one, with gradients on, outside a root forward) or efficient-kan's forward
    with ``update_grid=True`` under no_grad (an evaluation forward to the recorder): no
    event, no warning, and the same weights as without the recorder."""
    def run(out_dir):
        model = M.make_kan()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        crit = nn.MSELoss()
        with (contextlib.nullcontext() if out_dir is None else FlightRecorder(
                model, opt, loss_fn=crit, out_dir=out_dir,
                factory="kan_splines_models:make_kan")):
            for step in range(6):
                x, y = regression(step)
                if step in (2, 4) and how == "pykan":
                    model.update_grid_from_samples(x)
                elif step in (2, 4):
                    with torch.no_grad():
                        model(x, update_grid=True)
                opt.zero_grad()
                (crit(model(x), y) + 1e-4 * model.regularization_loss()).backward()
                opt.step()
        return model
    import logging
    import warnings
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING):
        warnings.simplefilter("error")
        recorded = run(tmp_path)
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    assert same_state(recorded, run(None))
    assert not list(tmp_path.glob("*.nan"))
