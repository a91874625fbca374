"""End to end: deep anomaly detection and one-class training (Deep SVDD, DAGMM, an autoencoder
on standardised features, a Gaussian density score through ``MultivariateNormal``) written as
their repositories write them (``anomaly_detection_models``), trained under the recorder until
a planted bug fires, then replayed with the CLI; healthy runs raise nothing and train the
same weights as without the recorder."""

from __future__ import annotations

import contextlib
import re

import anomaly_detection_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line
from torch.utils.data import DataLoader

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("anomaly_detection_models.py", text)


def recording(record: bool, out_dir, factory: str, model, opt, loss_fn=None):
    if not record:
        return contextlib.nullcontext()
    return FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=out_dir,
                          factory=f"anomaly_detection_models:{factory}")


def shuffled(X, batch_size: int = M.BATCH, drop_last: bool = False):
    return DataLoader(X, batch_size=batch_size, shuffle=True, drop_last=drop_last,
                      generator=torch.Generator().manual_seed(1))


def same_state(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# --------------------------------------------------------------------------------------------
# Deep SVDD


def train_svdd(out_dir, objective: str, record: bool = True, epochs: int = 5):
    """Deep-SVDD-PyTorch's trainer: c from an initial forward pass (eps trick), Adam with
    weight decay and a MultiStepLR, R set to the (1 - nu)-quantile after the warm-up; each
    epoch scores a test set of normal records and anomalies (far out, blank) in eval mode
    under no_grad, as its tester does."""
    torch.manual_seed(0)
    model = M.make_svdd()
    g = torch.Generator().manual_seed(0)
    loader = shuffled(M.normal_data(g))
    test = torch.cat([M.normal_data(g, 8), 50 * torch.randn(4, M.FEATURES, generator=g),
                      torch.zeros(2, M.FEATURES)])
    scores = []
    model.c.copy_(M.init_center_c(model, loader))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=1e-6)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[3], gamma=0.1)
    R, nu = torch.tensor(0.0), 0.1
    with recording(record, out_dir, "make_svdd", model, opt, M.svdd_loss) as rec:
        loss_fn = rec.loss_fn if record else M.svdd_loss
        for epoch in range(epochs):
            for x in loader:
                opt.zero_grad()
                outputs = model(x)
                loss = loss_fn(outputs, model.c, R, nu, objective)
                loss.backward()
                opt.step()
                if objective == "soft-boundary" and epoch >= 2:  # warm_up_n_epochs
                    dist = torch.sum((outputs.detach() - model.c) ** 2, dim=1)
                    R = M.get_radius(dist, nu)
            sched.step()
            model.eval()
            with torch.no_grad():
                dist = torch.sum((model(test) - model.c) ** 2, dim=1)
                scores.append(dist - R ** 2 if objective == "soft-boundary" else dist)
            model.train()
    return model, R, torch.stack(scores)


@pytest.mark.parametrize("objective", ["one-class", "soft-boundary"])
def test_healthy_deep_svdd_has_no_event_and_trains_the_same_weights(tmp_path, objective):
    model, R, scores = train_svdd(tmp_path, objective)
    assert not list(tmp_path.glob("*.nan"))
    bare, R_bare, scores_bare = train_svdd(tmp_path, objective, record=False)
    assert same_state(model, bare) and torch.equal(R, R_bare)
    assert torch.equal(scores, scores_bare) and scores.isfinite().all()
    assert (scores[-1, 8:12] > scores[-1, :8].max()).all()  # (the far anomalies score high)
    assert (model.c.abs() >= 0.1).all()  # (the eps trick kept the centre off 0)


# --------------------------------------------------------------------------------------------
# DAGMM


def train_dagmm(out_dir, X, record: bool = True, epochs: int = 2, drop_last: bool = False,
                loss_fn=M.dagmm_loss):
    """danieltan07/dagmm's solver: Adam, the loss of reconstruction, energy and the penalty on
    the covariances' diagonals, gradients clipped to 5."""
    torch.manual_seed(0)
    model = M.make_dagmm()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    loader = shuffled(X, drop_last=drop_last)
    with recording(record, out_dir, "make_dagmm", model, opt, loss_fn) as rec:
        loss_fn = rec.loss_fn if record else loss_fn
        for _epoch in range(epochs):
            for x in loader:
                opt.zero_grad()
                enc, dec, z, gamma = model(x)
                loss = loss_fn(x, dec, z, gamma)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 5)
                opt.step()
    return model


def test_healthy_dagmm_has_no_event_and_trains_the_same_weights(tmp_path):
    X = M.normal_data(torch.Generator().manual_seed(0), n=66)
    model = train_dagmm(tmp_path, X, drop_last=True)
    assert not list(tmp_path.glob("*.nan"))
    assert same_state(model, train_dagmm(tmp_path, X, record=False, drop_last=True))


def test_dagmm_blank_record_relative_distance_is_a_division_by_its_zero_norm(tmp_path):
    # |x - x'| / |x| of an all-zero record is +inf: z, then gamma and the GMM go NaN, and the
    # loss's cholesky raises on the NaN covariance; the recorder has the forward event
    X = M.normal_data(torch.Generator().manual_seed(0))
    X[37] = 0
    with pytest.raises(torch.linalg.LinAlgError) as info:
        train_dagmm(tmp_path, X)
    assert any("phase forward" in n for n in getattr(info.value, "__notes__", [])), info.value
    [bundle] = tmp_path.glob("*.nan")
    first = next(iter(shuffled(X)))  # the first batch, as the loader drew it
    blank = (first.norm(dim=1) == 0).nonzero().flatten().tolist()
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["event"]["step"], rep["reproduced"], o["phase"], o["module"], o["op"],
            o["made"], o["samples"]) == (0, True, "forward", "", "aten.div", "+inf", blank), rep
    assert o["source"] == line_of("/ a.norm(2, dim=1)"), o
    hint = rep["hint"]
    assert rep["cause"] == "invalid" and "aten.div by 0" in hint, rep
    # (was: "add an eps to the denominator (std + eps)", which makes |x'| / eps of the record)
    assert "norm of the batch's own records" in hint and "all zeros" in hint, hint
    assert "std + eps" not in hint, hint
    assert any("_LinAlgError" in p or "cholesky" in p for p in rep["problems"]), rep["problems"]


def first_nonfinite_loss(X, loss_fn) -> tuple[int, bool]:
    """(step, raised) of ``train_dagmm``'s training without the recorder: the first step whose
    loss is non-finite or whose decomposition raised LinAlgError (``raised``)."""
    torch.manual_seed(0)
    model = M.make_dagmm()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    step = 0
    for _epoch in range(2):
        for x in shuffled(X):
            opt.zero_grad()
            try:
                loss = loss_fn(x, *model(x)[1:])
            except torch.linalg.LinAlgError:
                return step, True
            if not torch.isfinite(loss):
                return step, False
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5)
            opt.step()
            step += 1
    raise AssertionError("no failure")


@pytest.mark.parametrize("loss_fn, op, line", [
    ("dagmm_loss", "aten.linalg_cholesky_ex", "torch.linalg.cholesky(cov_k)"),
    ("dagmm_loss_inverse", "aten.linalg_inv_ex", "torch.inverse(cov_k)")])
def test_dagmm_last_short_batch_covariance_fails_as_few_samples(tmp_path, loss_fn, op, line):
    # 66 records in batches of 16 leave 2 for the epoch's last step: each component's 3x3
    # covariance of 2 points has rank 1, and float32 cannot hold DAGMM's 1e-12 on its diagonal
    X = M.normal_data(torch.Generator().manual_seed(0), n=66)
    step, raised = first_nonfinite_loss(X, getattr(M, loss_fn))
    if not raised:  # (MKL's float32 LU on an Intel Xeon does not refuse the rank-1 matrix,
        # as it does on the AMD EPYC: torch.inverse returns, and the logdet after it is NaN)
        with pytest.raises(NonFiniteError) as info:
            train_dagmm(tmp_path, X, loss_fn=getattr(M, loss_fn))
        rep = nanreplay_json(info.value.bundle_path)
        o = rep["origin"]
        assert (rep["event"]["step"], o["module"], o["op"], o["made"], o["batch_size"]) == (
            step, "<loss>", "aten.logdet", "nan", 2), rep
        assert rep["cause"] == "precision" and "determinant is negative" in rep["hint"], rep
        assert "jitter on its diagonal" in rep["hint"], rep["hint"]
        return
    with pytest.raises(torch.linalg.LinAlgError):
        train_dagmm(tmp_path, X, loss_fn=getattr(M, loss_fn))
    [bundle] = tmp_path.glob("*.nan")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["event"]["step"], rep["reproduced"], o["phase"], o["module"], o["op"],
            o["made"], o["samples"], o["batch_size"]) == (
        step, True, "loss", "<loss>", op, "LinAlgError", [], 2), rep
    assert o["source"] == line_of(line), o
    hint = rep["hint"]
    assert rep["cause"] == "precision" and re.search(r"smallest \w+ ?value 1e-12,", hint), rep
    # (was: only "add jitter scaled to the matrix": the batch's size was the reason)
    assert "holds 2 samples, fewer than the matrix's 3 dimensions" in hint, hint
    assert "drop_last=True" in hint, hint


def test_dagmm_logdet_of_a_three_sample_covariance_rounded_negative_is_precision(tmp_path):
    # 67 records leave 3: each covariance of 3 points in 3 dimensions is singular but for
    # the 1e-12, and float32 rounds one determinant below 0: torch.logdet is NaN at the end
    # of an epoch (the plain run's oracle gives the step: the second epoch's on the AMD EPYC's
    # AVX-512 and AVX2 kernels, where the covariance itself rounds indefinite; the first's on
    # an Intel Xeon, and with scalar kernels, where the covariance is positive-definite in
    # float64 and logdet's own float32 LU rounds its determinant negative: precision too)
    X = M.normal_data(torch.Generator().manual_seed(0), n=67)
    step, raised = first_nonfinite_loss(X, M.dagmm_loss_inverse)
    assert not raised
    with pytest.raises(NonFiniteError) as info:
        train_dagmm(tmp_path, X, loss_fn=M.dagmm_loss_inverse)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"]) == (step, "loss", "<loss>"), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], o["phase"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "loss", "<loss>", "aten.logdet", "nan", [0, 1, 2]), rep
    assert o["source"] == line_of("torch.logdet(cov_k)"), o
    hint = rep["hint"]
    assert rep["cause"] == "precision" and "determinant is negative" in hint, rep
    assert "jitter on its diagonal" in hint, hint


def score_with_dagmm(out_dir, strict_inf: bool):
    """Two epochs of DAGMM, each followed by its test phase: the energy of 8 normal records
    and 4 near-blank ones (norm ~1e-3, whose relative distance |x - x'| / |x| is huge) under
    the mixture kept from training, in eval mode under no_grad."""
    torch.manual_seed(0)
    model = M.make_dagmm_scorer()
    g = torch.Generator().manual_seed(0)
    loader = shuffled(M.normal_data(g))
    test = torch.cat([M.normal_data(g, 8), 1e-3 * torch.randn(4, M.FEATURES, generator=g)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    energies = []
    with FlightRecorder(model, opt, loss_fn=M.dagmm_loss, out_dir=out_dir, strict_inf=strict_inf,
                        factory="anomaly_detection_models:make_dagmm_scorer") as rec:
        for _epoch in range(2):
            model.train()
            for x in loader:
                opt.zero_grad()
                enc, dec, z, gamma = model(x)
                rec.loss_fn(x, dec, z, gamma).backward()
                opt.step()
            model.eval()
            with torch.no_grad():
                energies.append(model(test))
    return energies


def test_test_phase_energy_of_a_hand_written_log_sum_exp_underflows(tmp_path):
    # every component's exp(log_p) of a near-blank record underflows to 0: log(0) = -inf
    # and the energy is +inf. An infinity an evaluation forward returns is the user's to
    # take by default (no event); with strict_inf it is one, named as an underflow
    energies = score_with_dagmm(tmp_path / "default", strict_inf=False)
    assert not list((tmp_path / "default").glob("*.nan"))
    inf = (energies[0] == float("inf")).nonzero().flatten().tolist()
    assert inf == [8, 9, 10, 11], energies[0]
    with pytest.raises(NonFiniteError) as info:
        score_with_dagmm(tmp_path, strict_inf=True)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["evaluation"], ev["samples"]) == (
        4, "forward", "", True, inf), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "", "aten.log", "-inf", inf), rep
    assert o["source"] == line_of("-torch.log(torch.sum(torch.exp(log_p), dim=1))"), o
    hint = rep["hint"]
    assert rep["cause"] == "underflow" and "logsumexp" in hint, rep


def train_sharpened_dagmm(out_dir, record: bool = True, steps: int = 24):
    """DAGMM with the memberships' entropy in the loss and their softmax's temperature
    annealed down tenfold each epoch; returns the memberships and loss of the last step."""
    torch.manual_seed(0)
    model = M.make_dagmm()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    loader = shuffled(M.normal_data(torch.Generator().manual_seed(0)))
    batches = [(epoch, x) for epoch in range(6) for x in loader]
    with recording(record, out_dir, "make_dagmm", model, opt, M.dagmm_entropy_loss) as rec:
        loss_fn = rec.loss_fn if record else M.dagmm_entropy_loss
        for epoch, x in batches[:steps]:
            model.temperature = 0.1 ** epoch
            opt.zero_grad()
            enc, dec, z, gamma = model(x)
            loss = loss_fn(x, dec, z, gamma)
            loss.backward()
            opt.step()
    return gamma, loss


def test_membership_softmax_underflow_then_log_in_the_entropy_is_underflow(tmp_path):
    # at temperature 0.01 a record's membership of a far component is exp(-170): 0 in
    # float32, log(0) is -inf and the entropy's 0 * -inf is NaN
    with pytest.raises(NonFiniteError) as info:
        train_sharpened_dagmm(tmp_path)
    ev = info.value.event
    assert (ev["phase"], ev["module"]) == ("loss", "<loss>"), ev
    # the same run without the recorder, to that step: which memberships are exactly 0
    gamma, loss = train_sharpened_dagmm(tmp_path, record=False, steps=ev["step"] + 1)
    assert loss.isnan()
    zero = (gamma == 0).any(1).nonzero().flatten().tolist()
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], o["phase"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "loss", "<loss>", "aten.log", "-inf", zero), rep
    assert [c["op"] for c in o["chain"]] == ["aten.log", "aten.mul"], o["chain"]
    assert o["source"] == line_of("gamma * torch.log(gamma)"), o
    hint = rep["hint"]
    assert rep["cause"] == "underflow" and "log_softmax" in hint, rep
    assert any("<root>.temperature = 0.01" in p for p in rep["problems"]), rep["problems"]


# --------------------------------------------------------------------------------------------
# an autoencoder on standardised features


@pytest.mark.parametrize("factory", ["make_normalised_ae", "make_normalised_ae_float_flag"])
def test_std_buffer_of_a_constant_feature_is_zero_over_zero_in_the_normaliser(tmp_path,
                                                                               factory):
    # a sensor stuck at 1.0 through the first window: the std buffer the first forward sets
    # is 0 in that feature, and (x - mean) / std is 0/0 in every row of it
    torch.manual_seed(0)
    model = getattr(M, factory)()
    X = M.normal_data(torch.Generator().manual_seed(0))
    X[:M.BATCH, 3] = 1.0
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with pytest.raises(NonFiniteError) as info, recording(
            True, tmp_path, factory, model, opt, M.ae_loss) as rec:
        for x in DataLoader(X, batch_size=M.BATCH):  # a time series: windows in order
            opt.zero_grad()
            out, xn = model(x)
            rec.loss_fn(out, xn).backward()
            opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "forward", "norm"), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "norm", "aten.div", "nan", list(range(M.BATCH))), rep
    assert o["source"] == line_of("return (x - self.mean) / self.std"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep
    # (the float init flag, 0 as the step began, is no running statistic to start at 1)
    assert "initialized" not in rep["hint"], rep["hint"]


def train_scored_ae(out_dir, factory: str, record: bool = True, epochs: int = 2):
    """An autoencoder trained on MSE that returns each record's standardised score beside
    its reconstruction (the score is monitored, not trained on)."""
    torch.manual_seed(0)
    model = getattr(M, factory)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = shuffled(M.normal_data(torch.Generator().manual_seed(0)))
    crit = torch.nn.MSELoss()
    with recording(record, out_dir, factory, model, opt, crit):
        for _epoch in range(epochs):
            for x in loader:
                opt.zero_grad()
                x_hat, score = model(x)
                crit(x_hat, x).backward()
                opt.step()
    return model


def test_running_variance_buffer_started_at_zero_names_the_buffer_not_the_batch(tmp_path):
    # err_var starts at 0 and the forward divides by its sqrt before updating it: every
    # score of step 0 is +inf
    with pytest.raises(NonFiniteError) as info:
        train_scored_ae(tmp_path, "make_scored_ae")
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "forward", ""), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "", "aten.div", "+inf", list(range(M.BATCH))), rep
    assert o["source"] == line_of("/ self.err_var.sqrt()"), o
    hint = rep["hint"]
    assert rep["cause"] == "invalid", rep
    # (was: "a count, sum or statistic over the batch ... or skip such batches": the batch
    # had nothing to do with it; the replay judged the buffer after the forward updated it)
    assert "comes from buffer err_var, 0 as the step began" in hint, hint
    assert "running_var" in hint and "skip such batches" not in hint, hint


def test_healthy_scored_ae_has_no_event_and_trains_the_same_weights(tmp_path):
    model = train_scored_ae(tmp_path, "make_scored_ae_var_one")
    assert not list(tmp_path.glob("*.nan"))
    assert same_state(model, train_scored_ae(tmp_path, "make_scored_ae_var_one", record=False))


# --------------------------------------------------------------------------------------------
# a Gaussian density score through MultivariateNormal


def train_gaussian_score(out_dir, factory: str, record: bool = True, steps: int = 12):
    """A negative log-likelihood of each batch's embeddings under their own Gaussian, the
    loss handed to the recorder with record_loss (the loop computes it inline)."""
    torch.manual_seed(0)
    model = getattr(M, factory)()
    X = M.normal_data(torch.Generator().manual_seed(0))
    opt = torch.optim.Adam(model.parameters(), lr=3e-2)
    batches = [x for _epoch in range(3) for x in DataLoader(X, batch_size=M.BATCH)]
    with recording(record, out_dir, factory, model, opt) as rec:
        for x in batches[:steps]:
            opt.zero_grad()
            loss = model(x).mean()
            if record:
                rec.record_loss(loss)
            loss.backward()
            opt.step()
    return model


def dead_units(model, x) -> list[int]:
    with torch.no_grad():
        return (model.features(x) == 0).all(0).nonzero().flatten().tolist()


def test_multivariate_normal_of_a_dead_relu_unit_names_the_covariance_not_a_view(tmp_path):
    # the embeddings' last ReLU leaves a unit at 0 for the whole batch: the batch covariance
    # has a zero row and column and MultivariateNormal's PositiveDefinite check refuses it
    X = M.normal_data(torch.Generator().manual_seed(0))
    loader = DataLoader(X, batch_size=M.BATCH)
    with pytest.raises(ValueError, match="PositiveDefinite"):
        train_gaussian_score(tmp_path, "make_gaussian_score_nojitter")
    [bundle] = tmp_path.glob("*.nan")
    step = int(re.search(r"step(\d+)", bundle.name)[1])
    # the dead units at that step, in a run without the recorder stopped just before it
    before = train_gaussian_score(tmp_path, "make_gaussian_score_nojitter", record=False,
                                  steps=step)
    x = list(loader)[step % len(loader)]
    dead = dead_units(before, x)
    assert dead, "the planted dead unit did not happen"
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    # (was: aten.transpose, the check's own value.mT, on the MultivariateNormal line)
    # (made was "0.0655", the matrix's first entry, which nothing refused)
    assert (rep["reproduced"], o["phase"], o["module"], o["op"], o["made"]) == (
        True, "forward", "", "aten.add", "a matrix not positive-definite"), rep
    assert o["source"] == line_of("cov = zc.T @ zc"), o
    hint = rep["hint"]
    assert rep["cause"] == "invalid", rep
    # (was: "16 value(s) refused ... a scale through softplus": every entry of the matrix)
    assert "not positive-definite in float64 too" in hint and "softplus" not in hint, hint
    assert f"row and column {', '.join(map(str, dead))} of it are exactly 0" in hint, hint
    assert "ridge" in hint, hint


def test_healthy_gaussian_score_with_jitter_has_no_event_and_same_weights(tmp_path):
    model = train_gaussian_score(tmp_path, "make_gaussian_score", steps=12)
    assert not list(tmp_path.glob("*.nan"))
    assert same_state(model, train_gaussian_score(tmp_path, "make_gaussian_score",
                                                  record=False, steps=12))


def train_forecaster(out_dir, corrupt: float | None = None, record: bool = True):
    """A forecaster's negative log-likelihood of the next window under its Gaussian; the
    loop computes the loss inline and hands it over with record_loss. ``corrupt``: record 21
    multiplied by it (a corrupt window)."""
    torch.manual_seed(0)
    model = M.make_forecast_score()
    X = M.normal_data(torch.Generator().manual_seed(0))
    if corrupt is not None:
        X[21] *= corrupt
    Y = 0.5 * X[:, :M.REP]
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with recording(record, out_dir, "make_forecast_score", model, opt) as rec:
        for i in range(0, len(X), M.BATCH):
            opt.zero_grad()
            loss = -model(X[i:i + M.BATCH]).log_prob(Y[i:i + M.BATCH]).mean()
            if record:
                rec.record_loss(loss)
            loss.backward()
            opt.step()
    return model


def test_cholesky_factor_of_an_underflowed_softplus_is_underflow_not_precision(tmp_path):
    # a corrupt window (x -150) drives some of its softplus scales to 0 in float32: the
    # factor's diagonal holds 0 and LowerCholesky refuses that record's matrix
    with pytest.raises(ValueError, match="LowerCholesky"):
        train_forecaster(tmp_path, corrupt=-150.0)
    [bundle] = tmp_path.glob("*.nan")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["event"]["step"], rep["reproduced"], o["phase"], o["module"], o["made"],
            o["samples"]) == (1, True, "forward", "", "0", [21 - M.BATCH]), rep
    assert o["source"] == line_of("scale_tril=torch.diag_embed(F.softplus(raw_scale))"), o
    hint = rep["hint"]
    # (was: precision, "16 value(s) refused, from 0 to 109": every entry of the matrix)
    assert rep["cause"] == "underflow", rep
    assert "value(s) refused, all 0; float64 keeps them above 0" in hint, hint
    assert "sample(s) 5 of batch" in hint, hint


def test_healthy_forecaster_has_no_event_and_trains_the_same_weights(tmp_path):
    model = train_forecaster(tmp_path)
    assert not list(tmp_path.glob("*.nan"))
    assert same_state(model, train_forecaster(tmp_path, record=False))
