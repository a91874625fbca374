"""End to end: probabilistic and robust regression (``robust_regression_models``: a mean and
log-variance network under a hand-written Gaussian NLL, ``nn.GaussianNLLLoss``, Student-t and
Laplace likelihoods from ``torch.distributions``, a mixture density network, quantile
regression, Barron's general robust loss with a learnable shape, a Box-Cox NLL with a
learnable lambda, a censored (Tobit) likelihood, deep evidential regression), trained under
the recorder from a DataLoader until a planted bug of the domain fires, then replayed with the
CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import robust_regression_models as M
import torch
from bundles import nanreplay_json, source_line
from torch.utils.data import DataLoader, TensorDataset

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

BATCH = 32
ALL = list(range(BATCH))


def line_of(text: str) -> str:
    return source_line("robust_regression_models.py", text)


def fit(model, loss, data, opt, rec=None, epochs: int = 1) -> list[float]:
    """``epochs`` over ``data`` in batches of BATCH (x, y and any extra tensors the loss
    takes: the censoring flags); the losses seen."""
    call = rec.loss_fn if rec is not None else loss
    losses = []
    for _ in range(epochs):
        for x, y, *extra in DataLoader(TensorDataset(*data), batch_size=BATCH):
            value = call(model(x), y, *extra)
            opt.zero_grad()
            value.backward()
            opt.step()
            losses.append(float(value.detach()))
    return losses


def make(factory: str, loss, opt_cls=torch.optim.Adam, **kw):
    model = getattr(M, factory)()
    opt = opt_cls(list(model.parameters()) + list(loss.parameters()), **{"lr": 1e-2, **kw})
    return model, opt


def fire(tmp_path: Path, factory: str, loss, data, epochs: int = 1, opt_cls=torch.optim.Adam,
         **kw) -> NonFiniteError:
    model, opt = make(factory, loss, opt_cls, **kw)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=loss, out_dir=tmp_path,
                            factory=f"robust_regression_models:{factory}") as rec:
            fit(model, loss, data, opt, rec, epochs)
    return info.value


def report(err: NonFiniteError, step: int, phase: str, code: int = 0) -> tuple[dict, dict]:
    assert (err.event["step"], err.event["phase"]) == (step, phase), err.event
    rep = nanreplay_json(err.bundle_path, code=code)
    assert rep["reproduced"] is (code == 0), json.dumps(rep, indent=1)
    return rep, rep["origin"]


def found(rep: dict, o: dict) -> tuple:
    return o["module"], o["op"], o["made"], o["samples"], rep["cause"]


@pytest.mark.parametrize("factory,loss,data", [
    ("make_mean_variance", M.GaussianNLL(), "xy"),
    ("make_softplus_scale", M.TorchGaussianNLL(), "xy"),
    ("make_softplus_scale", M.StudentTNLL(), "xy"),
    ("make_softplus_scale", M.LaplaceNLL(), "xy"),
    ("make_mdn", M.MDNLoss(), "xy"),
    ("make_quantile", M.PinballLoss(), "xy"),
    ("make_point", M.BarronLoss(1.0), "xy"),
    ("make_point", M.RobustLoss("cauchy"), "xy"),
    ("make_point", M.RobustLoss("tukey"), "xy"),
    ("make_softplus_scale", M.TobitNLL(), "censored"),
    ("make_mean_variance", M.BoxCoxNLL(0.5), "positive"),
    ("make_evidential", M.EvidentialLoss(), "xy"),
])
def test_healthy_regressions_raise_nothing_and_train_bit_identically(tmp_path, factory, loss,
                                                                     data):
    x, y, cens = M.heteroscedastic()
    data = {"xy": (x, y), "censored": (x, y, cens), "positive": M.positive_targets()}[data]
    start = {k: v.clone() for k, v in loss.state_dict().items()}
    runs = []
    for recorded in (False, True):
        loss.load_state_dict(start)
        model, opt = make(factory, loss)
        if recorded:
            with FlightRecorder(model, opt, loss_fn=loss, out_dir=tmp_path,
                                factory=f"robust_regression_models:{factory}") as rec:
                losses = fit(model, loss, data, opt, rec)
        else:
            losses = fit(model, loss, data, opt)
        params = list(model.parameters()) + list(loss.parameters())
        runs.append((losses, [p.detach().clone() for p in params]))
    (plain, w0), (watched, w1) = runs
    assert plain == watched
    assert all(torch.equal(a, b) for a, b in zip(w0, w1))
    assert not list(tmp_path.glob("*.nan"))


def test_a_missing_target_read_as_nan_is_an_input_event_of_that_sample(tmp_path):
    """A reading lost in the export (NaN in y): the loss's target, named as data to fix."""
    x, y, _ = M.heteroscedastic()
    y[2 * BATCH + 5] = float("nan")
    err = fire(tmp_path, "make_mean_variance", M.GaussianNLL(), (x, y))
    rep, o = report(err, 2, "input")
    assert (o["samples"], rep["cause"]) == ([5], "input"), json.dumps(rep, indent=1)
    assert "regression targets), fix the data pipeline" in rep["hint"], rep["hint"]


def test_a_mixture_density_summed_before_log_underflows_at_an_outlier(tmp_path):
    """The textbook MDN likelihood ``log(sum_k pi_k N(y | mu_k, sigma_k))``: a target 60
    away from every component makes each density exp(-1800), 0 in float32 and float64."""
    x, y, _ = M.heteroscedastic()
    y[BATCH + 7] = 60.0
    err = fire(tmp_path, "make_mdn", M.MDNLoss(stable=False), (x, y))
    rep, o = report(err, 1, "loss")
    assert found(rep, o) == ("<loss>", "aten.log", "-inf", [7], "underflow"), \
        json.dumps(rep, indent=1)
    assert o["source"] == line_of("return -torch.log(pdf.sum(-1)).mean()")
    assert "logsumexp" in rep["hint"], rep["hint"]


def test_a_target_in_the_wrong_unit_overflows_the_squared_residual(tmp_path):
    """A reading stored in the wrong unit (3e20): ``(y - mu)^2`` overflows float32 in the
    Gaussian NLL at that sample, named as data out of scale, with --try drop."""
    x, y, _ = M.heteroscedastic()
    y[BATCH + 11] = 3e20
    err = fire(tmp_path, "make_mean_variance", M.GaussianNLL(), (x, y))
    rep, o = report(err, 1, "loss")
    assert found(rep, o) == ("<loss>", "aten.pow", "+inf", [11], "overflow"), \
        json.dumps(rep, indent=1)
    assert o["source"] == line_of("return (0.5 * (log_var + (y - mu) ** 2")
    assert "--try drop=11" in rep["hint"], rep["hint"]


def test_a_large_target_overflows_adams_second_moment_before_any_nan(tmp_path):
    """A 5e18 target: the loss (r^2 ~ 1e37) is finite, but the log-variance head's gradient
    squares past float32 in Adam's ``exp_avg_sq``: an optimizer event at the update."""
    x, y, _ = M.heteroscedastic()
    y[BATCH + 11] = 5e18
    err = fire(tmp_path, "make_mean_variance", M.GaussianNLL(), (x, y))
    rep, _ = report(err, 1, "optimizer", code=1)
    assert rep["cause"] == "overflow", json.dumps(rep, indent=1)
    assert "exp_avg_sq" in rep["hint"] and "clip_grad_norm_" in rep["hint"], rep["hint"]


def test_barrons_loss_started_at_its_l2_point_divides_by_alpha_minus_2(tmp_path):
    """Barron's general loss with its learnable shape started at alpha = 2 (the L2 case)
    divides ``(x / c)^2`` by ``|alpha - 2| = 0``. The report named the divisor 'the parameter
    <loss>.alpha ... exactly 0 in this step' and advised keeping alpha positive (exp,
    softplus): alpha was 2, and a positive parametrisation keeps it off 0, not off 2. It now
    says the divisor is alpha shifted by a number, 0 at alpha's value 2: a singular point of
    the formula, its limit (the L2 loss) to compute there or the difference to keep off 0."""
    x, y, _ = M.heteroscedastic()
    err = fire(tmp_path, "make_point", M.BarronLoss(alpha=2.0), (x, y))
    rep, o = report(err, 0, "loss")
    assert found(rep, o) == ("<loss>", "aten.div", "+inf", ALL, "invalid"), \
        json.dumps(rep, indent=1)
    assert o["source"] == line_of("return (b / a * ((sq / b + 1) ** (a / 2) - 1)).mean()")
    hint = rep["hint"]
    assert "made of the parameter <loss>.alpha alone by adding a number" in hint, hint
    assert "<loss>.alpha is 2 in this step" in hint and "singular point" in hint, hint
    assert "exactly 0 in this step" not in hint and "learn its log" not in hint, hint


def test_a_box_cox_lambda_started_at_0_sends_nan_through_the_wheres_other_branch(tmp_path):
    """Box-Cox with lambda started at 0 (the log transform) through ``torch.where(|lam| <
    1e-6, log(y), (y^lam - 1) / lam)``: the forward is finite, the dropped branch's 0/0
    sends NaN back through the division to lambda at every sample."""
    err = fire(tmp_path, "make_mean_variance", M.BoxCoxNLL(0.0), M.positive_targets())
    rep, o = report(err, 0, "backward")
    assert found(rep, o) == ("<loss>", "DivBackward0", "nan", ALL, "invalid"), \
        json.dumps(rep, indent=1)
    assert o["source"] == line_of("return torch.where(lam.abs() < 1e-6, torch.log(y)")
    assert o["masked"] is True, o
    assert "make the op's input safe before the op" in rep["hint"], rep["hint"]


def test_a_negative_reading_under_a_box_cox_transform_is_a_bad_record(tmp_path):
    """Box-Cox needs y > 0: a reading of -0.2 makes ``log(y)`` NaN at that sample."""
    x, y = M.positive_targets()
    y[3 * BATCH + 3] = -0.2
    err = fire(tmp_path, "make_mean_variance", M.BoxCoxNLL(0.5), (x, y))
    rep, o = report(err, 3, "loss")
    assert found(rep, o) == ("<loss>", "aten.log", "nan", [3], "invalid"), \
        json.dumps(rep, indent=1)
    assert "drop or repair such records" in rep["hint"], rep["hint"]


def tobit_data(censored_first: bool):
    """Readings in unscaled units (10x the standard data): the censored rows' z is ~40."""
    x, y, cens = M.heteroscedastic()
    order = torch.argsort(-cens, stable=True) if censored_first else torch.arange(len(y))
    return x[order], 10 * y[order], cens[order]


def test_tobit_log_one_minus_cdf_of_a_censored_row_rounds_to_log_0(tmp_path):
    """``log(1 - Normal.cdf(z))`` for a censored row 40 standard deviations above the
    prediction: the cdf rounds to 1, in float64 too: precision, log_ndtr(-z) the fix."""
    err = fire(tmp_path, "make_softplus_scale", M.TobitNLL(stable=False), tobit_data(True))
    rep, o = report(err, 0, "loss")
    assert (o["module"], o["op"], o["made"], rep["cause"]) == (
        "<loss>", "aten.log", "-inf", "precision"), json.dumps(rep, indent=1)
    assert o["source"] == line_of("tail = torch.log(1 - normal.cdf(z))")
    assert "log(1 − Φ(z)) = log_ndtr(−z)" in rep["hint"], rep["hint"]


def test_tobit_tail_of_uncensored_rows_masked_by_where_is_still_a_rounded_complement(
        tmp_path):
    """The same loss on a batch without censored rows: ``torch.where`` drops the tail of
    every uncensored row, but LogBackward0 at ``1 - cdf(z)`` rounded to 0 sends NaN back. The
    report said 'invalid', a pole 'in float64 too', with the generic advice of an eps; the
    backward finder now notes a normal cdf ``0.5 (1 + erf(z / sqrt 2))`` as a value below 1,
    so ``1 - cdf`` is a complement rounded to 0: precision, with log_ndtr(-z), and the mask."""
    x, y, cens = tobit_data(False)
    err = fire(tmp_path, "make_softplus_scale", M.TobitNLL(stable=False), (x, y, cens))
    rep, o = report(err, 0, "backward")
    with torch.no_grad():  # (the step's own model: 1 - cdf(z) is 0 in float32 there)
        mu, std = M.make_softplus_scale()(x[:BATCH])
        z = (y[:BATCH] - mu) / std
        rounded = (1 - torch.distributions.Normal(0.0, 1.0).cdf(z) == 0).nonzero()[:, 0]
    assert (o["module"], o["op"], o["made"], rep["cause"]) == (
        "<loss>", "LogBackward0", "nan", "precision"), json.dumps(rep, indent=1)
    assert o["samples"] == rounded.tolist() and not bool(cens[:BATCH].any()), o["samples"]
    assert o["source"] == line_of("tail = torch.log(1 - normal.cdf(z))")
    assert o["masked"] is True, o
    assert "log(1 − Φ(z)) = log_ndtr(−z)" in rep["hint"], rep["hint"]
    assert "make the masked entries' input safe before the op" in rep["hint"], rep["hint"]


def test_a_learning_rate_too_high_collapses_the_predicted_variance(tmp_path):
    """SGD at lr 1 on the mean-variance NLL: the log-variance is driven down until
    ``exp(-log_var)`` overflows at step 5; the precursors say the run was diverging."""
    x, y, _ = M.heteroscedastic()
    err = fire(tmp_path, "make_mean_variance", M.GaussianNLL(), (x, y), epochs=2,
               opt_cls=torch.optim.SGD, lr=1.0)
    rep, o = report(err, 5, "loss")
    assert (o["module"], o["op"], o["made"], rep["cause"]) == (
        "<loss>", "aten.exp", "+inf", "overflow"), json.dumps(rep, indent=1)
    assert "the run was diverging" in rep["hint"], rep["hint"]


def test_a_raw_variance_head_refused_by_gaussian_nll_loss_names_the_head(tmp_path):
    """``nn.GaussianNLLLoss`` given the head's output as the variance, as is: a feature read
    in the wrong unit (x = -40) drives it below 0 at that sample, and the loss raises its own
    ``ValueError: var has negative entry/entries``. The recorder let that error through with
    no bundle (it knew only torch.distributions' checks); the check is now a constraint event,
    and the replay reads the refused ``var`` from the loss's frame: the head's addmm, the
    sample, invalid, a positive parametrisation."""
    x, y, _ = M.heteroscedastic()
    x[4] = -40.0
    loss = M.TorchGaussianNLL(squared=False)
    model, opt = make("make_raw_scale", loss)
    with pytest.raises(ValueError, match="var has negative") as info:
        with FlightRecorder(model, opt, loss_fn=loss, out_dir=tmp_path,
                            factory="robust_regression_models:make_raw_scale") as rec:
            fit(model, loss, (x, y), opt, rec)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "gaussian_nll_loss refused its argument var" in notes, notes
    rep = nanreplay_json(notes.split("Bundle: ")[1].split(";")[0])
    o = rep["origin"]
    assert rep["event"]["step"] == 0
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == (
        "spread", "aten.addmm", [4], "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == line_of("mu, s = self.mean(h)[:, 0], self.spread(h)[:, 0]")
    assert "satisfy it by construction (a scale through softplus" in rep["hint"], rep["hint"]


def test_tukey_irls_weights_all_0_in_a_batch_of_unscaled_targets_divide_0_by_0(tmp_path):
    """Tukey's biweight as IRLS with c = 4.685 on targets in another unit (x1000, never
    standardised): every residual is beyond c, every weight 0, and the weighted mean's
    ``sum(w r^2) / sum(w)`` is 0/0: a 0-d divisor, no row to blame."""
    x, y, _ = M.heteroscedastic()
    err = fire(tmp_path, "make_point", M.TukeyIRLS(), (x, 1000 * y))
    rep, o = report(err, 0, "loss")
    assert found(rep, o) == ("<loss>", "aten.div", "nan", [], "invalid"), \
        json.dumps(rep, indent=1)
    assert o["source"] == line_of("return (w * r ** 2).sum() / w.sum()")
    assert "no row is to blame" in rep["hint"], rep["hint"]


def test_a_relu_scale_of_0_refused_by_laplace_names_the_relu_and_the_sample(tmp_path):
    """A Laplace scale through ReLU: a feature in the wrong unit (x = -40) puts the scale
    head below its kink, 0, which ``torch.distributions.Laplace`` refuses: the relu at that
    sample, invalid, a softplus with a floor."""
    x, y, _ = M.heteroscedastic()
    x[4] = -40.0
    loss = M.LaplaceNLL()
    model, opt = make("make_relu_scale", loss)
    with pytest.raises(ValueError, match="GreaterThan") as info:
        with FlightRecorder(model, opt, loss_fn=loss, out_dir=tmp_path,
                            factory="robust_regression_models:make_relu_scale") as rec:
            fit(model, loss, (x, y), opt, rec)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    rep = nanreplay_json(notes.split("Bundle: ")[1].split(";")[0])
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == (
        "", "aten.relu", [4], "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == line_of("return mu, F.relu(s)")
    assert "Laplace refused its parameter scale" in rep["hint"], rep["hint"]
