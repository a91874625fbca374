"""End to end on uncertainty estimation and calibration (``uncertainty_estimation_models``):
Sensoy et al.'s evidential classifier (relu/softplus/exp evidence, the digamma loss and the
annealed lgamma/digamma KL to the uniform Dirichlet), a deep-ensemble member's heteroscedastic
NLL, an MC-dropout classifier under a confidence penalty with BALD acquisition in the loop,
the focal loss, SNGP's spectral-normalised GP head with its per-batch precision matrix, and
temperature scaling fitted by LBFGS. Each planted bug of the domain fires under the recorder
and is replayed with the CLI; the healthy versions raise no event and train bit-identically
with and without the recorder."""

from __future__ import annotations

import contextlib

import pytest
import torch
import uncertainty_estimation_models as M
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

SPECS = {  # kind: (factory, batches, loss)
    "edl_relu": ("make_edl_relu", M.class_batch, M.EDLLoss),
    "edl_softplus": ("make_edl_softplus", M.class_batch, M.EDLLoss),
    "edl_exp": ("make_edl_exp", M.class_batch, M.EDLLoss),
    "hetero": ("make_hetero", M.regression_batch, lambda: M.gaussian_nll),
    "exp_var": ("make_exp_var", M.regression_batch, lambda: M.variance_nll),
    "ensemble": ("make_ensemble_member", M.regression_batch, M.EnsembleNLL),
    "joint": ("make_joint_ensemble", M.price_batch, lambda: M.mixture_nll),
    "der": ("make_der", M.regression_batch, lambda: M.nig_nll),
    "penalty": ("make_mc_dropout", M.class_batch, M.ConfidencePenalty),
    "focal": ("make_focal", M.class_batch, lambda: M.FocalLoss(gamma=0.5)),
    "sngp": ("make_sngp", M.class_batch, torch.nn.CrossEntropyLoss),
    "sngp_no_ridge": ("make_sngp_no_ridge", M.class_batch, torch.nn.CrossEntropyLoss),
    "sngp_inv": ("make_sngp_inv_no_ridge", M.class_batch, torch.nn.CrossEntropyLoss),
}


def line_of(text: str) -> str:
    return source_line("uncertainty_estimation_models.py", text)


def train(kind: str, out_dir, bad: int | None = None, scale: float = 1.0, steps: int = 4,
          lr: float = 1e-3, record: bool = True, acquire: bool = False, amp: bool = False):
    """AdamW with a step schedule and gradient clipping; the EDL loss's annealing epoch set by
    the loop; record ``bad`` of the last step's batch ``scale`` times too large; ``acquire``:
    BALD scores of a pool between steps (dropout on, no grad), as active learning does;
    ``amp``: forward and loss under bfloat16 autocast."""
    make, data, loss = SPECS[kind]
    model, crit = getattr(M, make)(), loss()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(1)  # (dropout)
    pool, _ = M.class_batch(torch.Generator().manual_seed(9), n=32)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"uncertainty_estimation_models:{make}") if record else None
    model.losses = []
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for step in range(steps):
            if isinstance(crit, M.EDLLoss):
                crit.epoch = step
            x, y = data(g, bad if step == steps - 1 else None, scale=scale)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                out = model(x)
                loss = loss_fn(*(out if isinstance(out, tuple) else (out,)), y)
            opt.zero_grad()
            loss.backward()
            model.losses.append(loss.detach())
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if acquire:
                with torch.no_grad():
                    model.scores = M.bald(model, pool)
    return model


def fire(kind: str, tmp_path, **kw):
    with pytest.raises(NonFiniteError) as info:
        train(kind, tmp_path, **kw)
    return info.value.event, info.value.bundle_path


def dead_evidence_rows(step: int) -> list[int]:
    """The rows of step ``step``'s batch whose every logit is <= 0 (relu evidence all 0),
    on an unrecorded copy of the run trained up to that step."""
    model = train("edl_relu", None, steps=step, lr=1e-2, record=False)
    g = torch.Generator().manual_seed(0)
    for _ in range(step + 1):
        x, _ = M.class_batch(g)
    with torch.no_grad():
        return torch.nonzero((model.body(x) <= 0).all(1)).flatten().tolist()


def test_relu_evidence_of_a_dead_record_names_the_belief_division_and_its_rows(tmp_path):
    """Relu evidence with the KL's annealing pushing misleading evidence down: within a few
    steps a training record has every logit <= 0, so its evidence is all 0 (alpha exactly 1,
    fine for the digamma loss) and the belief mass e / (S - K) is 0/0. The replay names the
    division in the loss, those very rows (counted on an unrecorded run) and an eps."""
    ev, bundle = fire("edl_relu", tmp_path, steps=30, lr=1e-2)
    step = ev["step"]
    rows = dead_evidence_rows(step)
    assert rows and (ev["phase"], ev["kind"]) == ("loss", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], rep["event"]["step"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, step, "<loss>", "aten.div", "nan", rows), o
    assert o["source"] == line_of("belief = evidence / (S - K)"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"] and "eps" in rep["hint"], rep


def test_unrecorded_relu_evidence_logs_a_nan_loss_from_that_step(tmp_path):
    """Without the recorder the same run logs a NaN loss from the event's step on (relu's
    backward gives the dead rows' NaN gradient back as 0, so the weights stay finite and the
    NaN is only in what the user monitors): the event above is the bug, at its first step."""
    ev, _ = fire("edl_relu", tmp_path, steps=30, lr=1e-2)
    model = train("edl_relu", tmp_path, steps=30, lr=1e-2, record=False)
    finite = [bool(torch.isfinite(v)) for v in model.losses]
    assert finite.index(False) == ev["step"], finite


def test_exp_evidence_of_an_out_of_scale_record_overflows_in_the_model(tmp_path):
    """Exp evidence without the reference's logit clamp: a record 1000x out of scale makes
    exp(logits) +inf in the model's forward. Named at the exp, on that record, as overflow
    of out-of-scale data; dropping it makes the step finite."""
    ev, bundle = fire("edl_exp", tmp_path, bad=5, scale=1000.0)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"], ev["kind"]) == (
        3, "forward", "", [5], "+inf"), ev
    rep = nanreplay_json(bundle, "--try", "drop=5")
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == (
        "", "aten.exp", [5], "overflow"), rep
    assert o["source"] == line_of("evidence = torch.exp(logits)"), o
    assert "out of scale" in rep["hint"] and "clamp" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


@pytest.mark.parametrize("kind,line", [
    ("hetero", "return (0.5 * torch.log(var) + (y - mu) ** 2 / (2 * var)).mean()  # the bug"),
    ("exp_var", "(y - mu) ** 2 / (2 * var)).mean()  # log of the head's exp")])
def test_log_variance_underflow_names_the_log_of_its_exp_and_the_record(tmp_path, kind, line):
    """A hand-written Gaussian NLL takes log(exp(log_var)), the exp in the loss or in the
    model's head: a record 2000x out of scale drives its log-variance to about -170, exp
    rounds it to 0 and log(0) is -inf (then -inf + inf). Named at the log on the record's row,
    underflow, with the rewrite that removes the round trip (log(exp(s)) is s) and the
    record's out-of-scale data; dropping it makes the step finite."""
    ev, bundle = fire(kind, tmp_path, bad=2, scale=2000.0)
    assert (ev["step"], ev["phase"], ev["kind"]) == (3, "loss", "nan"), ev
    rep = nanreplay_json(bundle, "--try", "drop=2")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == (
        "<loss>", "aten.log", "-inf", [2], "underflow"), rep
    assert o["source"] == line_of(line), o
    assert "log(exp(x)) is x" in rep["hint"] and "out of scale" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_joint_ensemble_variance_by_moments_is_named_a_cancellation(tmp_path):
    """A jointly trained ensemble's moment-matched variance E[var + mu^2] - E[mu]^2 on prices
    in their own units (mu ~ 2.5e5, mu^2 ~ 6e10, float32's spacing there ~ 8e3): the two
    terms agree to rounding and the difference is 0 or negative for some records at the first
    step (float64: 0.665), whose log is -inf or NaN. Named at the log, on exactly those
    records, precision, with the variance's stable form (torch.var, centring) as the fix."""
    ev, bundle = fire("joint", tmp_path)
    model = M.make_joint_ensemble()
    x, _ = M.price_batch(torch.Generator().manual_seed(0))
    with torch.no_grad():
        mus, variances = model(x)
        var = (variances + mus ** 2).mean(0) - mus.mean(0) ** 2
    rows = torch.nonzero(var <= 0).flatten().tolist()  # (log: NaN below 0, -inf at 0)
    assert rows and (ev["step"], ev["phase"], ev["kind"]) == (0, "loss", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == (
        "<loss>", "aten.log", "nan", rows, "precision"), rep
    assert o["source"] == line_of("(y - mu) ** 2 / (2 * var)).mean()  # of the mixture"), o
    assert "E[x²] − E[x]²" in rep["hint"] and "torch.var" in rep["hint"], rep["hint"]


def test_evidential_regression_relu_nu_names_the_pole_and_the_relu_behind_it(tmp_path):
    """Deep evidential regression with nu = relu(.): the evidence regulariser pushes nu down
    and within a few steps a record's nu is exactly 0, so log(pi / nu) is +inf. Named at the
    reciprocal in the NIG NLL, on exactly the records whose nu is 0 (counted on an unrecorded
    run), invalid, with the model output and the relu that made the 0 and softplus as the
    fix, not only an eps in the loss."""
    ev, bundle = fire("der", tmp_path, steps=40, lr=1e-2)
    step = ev["step"]
    model = train("der", None, steps=step, lr=1e-2, record=False)
    g = torch.Generator().manual_seed(0)
    for _ in range(step + 1):
        x, _ = M.regression_batch(g)
    with torch.no_grad():
        rows = torch.nonzero(model(x)[1] == 0).flatten().tolist()
    assert rows and (ev["phase"], ev["kind"]) == ("loss", "+inf"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == (
        "<loss>", "aten.reciprocal", "+inf", rows, "invalid"), rep
    assert o["source"] == line_of("nll = (0.5 * torch.log(math.pi / nu)"), o
    assert "model's output[1]" in rep["hint"] and "made by aten.relu" in rep["hint"], rep
    assert "softplus(x) + eps" in rep["hint"], rep["hint"]


def test_entropy_penalty_of_an_underflowed_softmax_names_the_log(tmp_path):
    """The confidence penalty's entropy -(p * log p) of a record so confident that softmax
    rounds its other classes to 0: log(0) = -inf, then 0 * -inf. Named at the log, on the
    record, underflow, with log_softmax as the fix."""
    ev, bundle = fire("penalty", tmp_path, bad=5, scale=1000.0)
    assert (ev["step"], ev["phase"], ev["kind"]) == (3, "loss", "nan"), ev
    rep = nanreplay_json(bundle, "--try", "drop=5")
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == (
        "<loss>", "aten.log", [5], "underflow"), rep
    assert o["source"] == line_of("return -(p * torch.log(p)).sum(-1)"), o
    assert "log_softmax" in rep["hint"] and "out of scale" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_focal_loss_with_gamma_below_one_names_the_power_at_zero(tmp_path):
    """Focal loss with gamma = 0.5 on a record whose true class gets p = 1 in float32 (its
    logit margin past 17): (1 - p) ** 0.5 is 0 and its derivative infinite, NaN in backward.
    Named at PowBackward0 on that record; float64 keeps 1 - p positive, so it is precision,
    and the hint names the power's pole and a floor on its base."""
    ev, bundle = fire("focal", tmp_path, bad=5, scale=100.0)
    assert (ev["step"], ev["phase"], ev["kind"]) == (3, "backward", "nan"), ev
    rep = nanreplay_json(bundle, "--try", "drop=5")
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == (
        "<loss>", "PowBackward0", [5], "precision"), rep
    assert o["source"] == line_of("return (-(1 - p) ** self.gamma * logp).mean()"), o
    assert "x ** 0.5 has an infinite derivative at x = 0" in rep["hint"], rep["hint"]
    assert "clamp_min(eps) ** p" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_sngp_precision_without_ridge_is_named_singular(tmp_path):
    """SNGP's GP precision started at 0 I instead of the ridge I: after one batch of 16 it is
    a rank-16 sum of 64x64 outer products and Cholesky fails. The LinAlgError reaches the loop
    with a bundle; the replay names the Cholesky in the model, invalid in exact arithmetic,
    with a ridge on the diagonal as the fix."""
    with pytest.raises(torch.linalg.LinAlgError):
        train("sngp_no_ridge", tmp_path)
    (bundle,) = tmp_path.glob("*.nan")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["event"]["step"], o["module"], o["op"], rep["cause"]) == (
        0, "", "aten.linalg_cholesky_ex", "invalid"), rep
    assert o["source"] == line_of("L = torch.linalg.cholesky(self.precision)"), o
    assert "ridge" in rep["hint"] and "fewer samples than features" in rep["hint"], rep["hint"]


def test_sngp_inverse_of_a_singular_precision_names_the_inverse_behind_the_sqrt(tmp_path):
    """The same precision without its ridge, inverted with torch.linalg.inv, which raises
    only on an exactly singular matrix: the rank-16 64x64 precision comes back as a finite
    "covariance" of rounding noise, phi^T Sigma phi is negative for some records and the
    mean-field sqrt(1 + pi / 8 var) is NaN. The replay names the sqrt and its rows, and the
    hint sends the user to the inverse's line and the ridge, not to a clamp of the sqrt."""
    ev, bundle = fire("sngp_inv", tmp_path)
    model = M.make_sngp_inv_no_ridge()
    x, _ = M.class_batch(torch.Generator().manual_seed(0))
    torch.manual_seed(1)
    with torch.no_grad():
        rows = torch.nonzero(~torch.isfinite(model(x)).all(1)).flatten().tolist()
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (0, "forward", "", rows)
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == (
        "", "aten.sqrt", rows, "invalid"), rep
    assert o["source"] == line_of("return logits / torch.sqrt(1 + math.pi / 8 * var)"), o
    inv = line_of("cov = torch.linalg.inv(self.precision)")
    assert f"made from aten.linalg_inv_ex ({inv}) of a matrix singular" in rep["hint"], rep
    assert "add a ridge" in rep["hint"] and "clamping" in rep["hint"], rep["hint"]


@pytest.mark.parametrize("kind,acquire,amp", [
    ("edl_softplus", False, False), ("ensemble", False, False), ("ensemble", False, True),
    ("penalty", True, False), ("sngp", False, False), ("der", False, True)])
def test_healthy_runs_raise_nothing_and_train_the_same(tmp_path, kind, acquire, amp):
    """Softplus evidence (lgamma/digamma KL), GaussianNLLLoss on a softplus variance (also
    under bfloat16 autocast), MC dropout with BALD acquisition between steps (its dropout
    draws from the same RNG), SNGP (spectral norm's power iteration, the precision buffer
    updated in forward), evidential regression's NIG NLL under bfloat16 autocast (a few steps,
    before any nu reaches 0): no event, bit-identical weights and buffers with and without
    the recorder."""
    recorded = train(kind, tmp_path, steps=4, acquire=acquire, amp=amp)
    plain = train(kind, tmp_path, steps=4, acquire=acquire, amp=amp, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), name
    if acquire:
        assert torch.equal(recorded.scores, plain.scores)


def fit_temperature(out_dir, record: bool = True) -> float:
    """Guo et al.'s temperature scaling: LBFGS on a held-out set's logits (an overconfident
    model's: 4x its calibrated scale), several closure evaluations per step."""
    g = torch.Generator().manual_seed(3)
    y = torch.randint(0, M.K, (64,), generator=g)
    logits = 4 * (torch.randn(64, M.K, generator=g) + 2 * torch.nn.functional.one_hot(y, M.K))
    scaler, crit = M.make_temperature(), torch.nn.CrossEntropyLoss()
    opt = torch.optim.LBFGS(scaler.parameters(), lr=0.01, max_iter=50)
    rec = FlightRecorder(scaler, opt, loss_fn=crit, out_dir=out_dir,
                         factory="uncertainty_estimation_models:make_temperature") if record \
        else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit

        def closure():
            opt.zero_grad()
            loss = loss_fn(scaler(logits), y)
            loss.backward()
            return loss
        for _ in range(3):
            opt.step(closure)
    return scaler.temperature.item()


def test_temperature_scaling_by_lbfgs_fits_the_same_temperature(tmp_path):
    """LBFGS's closure runs up to 50 times a step under the recorder: no event, the same
    fitted temperature (above 1: the logits were overconfident)."""
    recorded = fit_temperature(tmp_path)
    assert not list(tmp_path.glob("*.nan"))
    assert recorded == fit_temperature(tmp_path, record=False) and recorded > 1.5


def train_masked(out_dir, record: bool = True, allow_inf=None, steps: int = 4,
                 accum: int = 2) -> torch.nn.Module:
    """MC dropout over records whose unavailable classes are -inf logits, cross-entropy
    (which reads only the label's logit and the log-sum-exp), two accumulated micro-batches a
    step."""
    model = M.make_masked_mc_dropout()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = torch.nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(1)
    kw = {} if allow_inf is None else {"allow_inf": allow_inf}
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, **kw,
                         factory="uncertainty_estimation_models:make_masked_mc_dropout") \
        if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for _ in range(steps):
            opt.zero_grad()
            for _ in range(accum):
                x, available, y = M.masked_batch(g)
                loss = loss_fn(model(x, available), y) / accum
                loss.backward()
            opt.step()
    return model


def test_masked_classes_in_the_output_name_the_fill_and_the_allow_inf_to_add(tmp_path):
    """By default a -inf reaching the root output is an event (the recorder cannot know the
    loss reads it only where allowed); the replay names the literal fill, intended, and the
    exact allow_inf setting that records such a model."""
    with pytest.raises(NonFiniteError) as info:
        train_masked(tmp_path)
    assert (info.value.event["step"], info.value.event["kind"]) == (0, "-inf")
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"]) == ("", "aten.masked_fill", "-inf"), o
    assert "allow_inf" in rep["hint"] and "allow_inf=['']" in " ".join(rep["problems"]), rep


def test_label_smoothing_over_masked_classes_names_the_sum_and_the_smoothing(tmp_path):
    """The same masked logits under allow_inf, with label_smoothing=0.1: the smoothing term
    sums log-probabilities over every class, the masked ones' -inf too, and the loss is
    +inf. The event says the model output holds no NaN (its -inf allowed, not "finite"); the
    replay names the sum that folded the intended -inf in, on the records with a masked
    class, and the smoothing spread over masked classes as the fix."""
    model = M.make_masked_mc_dropout()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    x, available, y = M.masked_batch(torch.Generator().manual_seed(0))
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path, allow_inf=[""],
                            factory="uncertainty_estimation_models:make_masked_mc_dropout"
                            ) as rec:
            opt.zero_grad()
            rec.loss_fn(model(x, available), y).backward()
            opt.step()
    ev = info.value.event
    assert (ev["phase"], ev["kind"]) == ("loss", "+inf"), ev
    assert ev["detail"] == ("the loss is non-finite while the model output holds no NaN (its "
                            "+-Inf, allowed, reached the loss)"), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    rows = torch.nonzero(~available.all(1)).flatten().tolist()
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == (
        "<loss>", "aten.sum", rows, "invalid"), rep
    assert "label smoothing" in rep["hint"] and "masked" in rep["hint"], rep["hint"]


def test_masked_classes_with_allow_inf_raise_nothing_and_train_the_same(tmp_path):
    """With allow_inf=[""] (the root's output): no event over accumulated micro-batches with
    dropout, and bit-identical weights with and without the recorder."""
    recorded = train_masked(tmp_path, allow_inf=[""])
    plain = train_masked(tmp_path, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name
