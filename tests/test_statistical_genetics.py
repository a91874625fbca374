"""End to end on statistical-genetics models written in plain torch
(``statistical_genetics_models``): 0/1/2 genotype matrices standardised per SNP by
``(g - 2p) / sqrt(2p(1-p))``, a polygenic risk score with covariates passed into ``forward``,
a sample-weighted case-control logistic loss holding the model for its L1/L2 or gene-wise
group-lasso penalty, gradient clipping, a REML variance-component model over the batch's
genomic relationship matrix ``Z Z^T / m`` and its Cholesky, and a neural ADMIXTURE
autoencoder, with batches from a DataLoader over individuals. Each planted bug of the domain
fires under the recorder and is replayed with the CLI; the healthy versions raise no event and
train bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import pytest
import statistical_genetics_models as M
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

STANDARDISE = "return (g - 2 * p) / torch.sqrt(2 * p * (1 - p))"
ALL = list(range(M.BATCH))


def line_of(text: str) -> str:
    return source_line("statistical_genetics_models.py", text)


def train_prs(make: str, out_dir, data: dict, lr: float = 1e-2, epochs: int = 2,
              record: bool = True, adam_eps: float = 1e-8, no_pc2: bool = False, **loss):
    """Adam over the PRS, the weighted case-control loss with its penalties, gradients
    clipped at 5; 64 individuals in batches of 16 (individual 16 k + r is row r of step k).
    ``no_pc2``: the second PC never computed, its covariate column 0."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=lr, eps=adam_eps)
    crit = M.CaseControlLoss(model, **loss)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"statistical_genetics_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for _ in range(epochs):
            for g, y, _trait, covar, w in M.loader(*M.genotypes(**data)):
                if no_pc2:
                    covar = torch.cat([covar[:, :2], torch.zeros(len(covar), 1)], 1)
                loss = loss_fn(model(g, covar), y, w)
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                opt.step()
    return model


def train_reml(make: str, out_dir, lr: float = 0.5, scale: float = 0.1, record: bool = True):
    """SGD on the REML likelihood of the quantitative trait (times ``scale``: a trait in other
    units, its variance 0.01 of the standardised one)."""
    model = getattr(M, make)()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    crit = M.REMLLoss()
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"statistical_genetics_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for _ in range(2):
            for g, _y, trait, _covar, _w in M.loader(*M.genotypes()):
                loss = loss_fn(*model(g), trait * scale)
                opt.zero_grad()
                loss.backward()
                opt.step()
    return model


def train_admixture(out_dir, product: bool, record: bool = True):
    model = M.make_admixture()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    crit = M.BinomialNLL(product)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory="statistical_genetics_models:make_admixture") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for _ in range(2):
            for g, *_ in M.loader(*M.genotypes()):
                loss = loss_fn(model(g), g)
                opt.zero_grad()
                loss.backward()
                opt.step()
    return model


def fire(train, *args, **kw):
    with pytest.raises(NonFiniteError) as info:
        train(*args, **kw)
    return info.value.event, info.value.bundle_path


def test_snp_monomorphic_in_a_batch_names_the_division_and_the_constant_column(tmp_path):
    """A rare SNP (column 7) whose minor alleles all sit outside step 2's batch, standardised
    by the batch's own allele frequency with no MAF filter: p = 0, (0 - 0) / sqrt(0) is 0/0 in
    every row. The replay names the division of the standardiser, every row (no individual is
    to blame) and that column 7 of the genotypes holds 0 throughout the batch."""
    ev, bundle = fire(train_prs, "make_prs_batch_freq", tmp_path, {"mono_in_batch": 2})
    assert (ev["step"], ev["phase"], ev["module"]) == (2, "forward", "std"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("std", "aten.div", "nan", ALL), o
    assert o["source"] == line_of(STANDARDISE), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "column(s) 7 of args[0] hold 0 in every row of the batch" in rep["hint"], rep["hint"]


def test_plink_minus_nine_call_names_the_individual_under_a_pooled_frequency(tmp_path):
    """Individual 37 (row 5 of step 2) has PLINK's -9 for a missing call at SNP 11, where the
    batch's other calls are mostly 0: the batch frequency p is below 0 and sqrt(2p(1-p)) is
    NaN. The sqrt pools every row; the hint used to say only 'clamp the op's input into its
    domain'. It names sample 5, the -9 as a missing-value code to impute, and dropping it."""
    ev, bundle = fire(train_prs, "make_prs_batch_freq", tmp_path, {"minus9": (37, 11)})
    assert (ev["step"], ev["phase"], ev["module"]) == (2, "forward", "std"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("std", "aten.sqrt", "nan", ALL), o
    assert o["source"] == line_of(STANDARDISE), o
    assert rep["cause"] == "invalid", rep["cause"]
    h = rep["hint"]
    assert "pools every sample of the batch" in h and "sample(s) 5 of args[0] hold -9" in h, h
    assert "missing-value code" in h and "--try drop=5" in h, h


def test_snp_monomorphic_in_the_training_set_names_the_frequency_buffer(tmp_path):
    """Training-set allele frequencies with no MAF filter: SNP 7 is carried by no individual,
    its frequency buffer is 0, and sqrt(2p(1-p)) divides 0 by 0 at step 0. The hint used to
    call the divisor 'a statistic over the batch (z.std(0))' and advise taking the
    statistics over the whole dataset, as the model already did; it names the buffer
    std.freq, entry 7, its value 0, and a MAF filter."""
    ev, bundle = fire(train_prs, "make_prs_unfiltered", tmp_path, {"monomorphic": 7})
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "forward", "std"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("std", "aten.div", "nan", ALL), o
    assert o["source"] == line_of(STANDARDISE), o
    assert rep["cause"] == "invalid", rep["cause"]
    h = rep["hint"]
    assert "made of the buffer std.freq alone" in h and "0 at entry 7 of its shape (120,)" in h, h
    assert "minor-allele-frequency" in h and "z.std(0)" not in h, h


def test_adam_without_eps_on_a_covariate_never_computed_names_its_weight(tmp_path):
    """Adam with eps=0 and the second PC left at 0 in every individual: that covariate's
    weight gets a gradient of exactly 0, m / sqrt(v) is 0/0, and the update writes NaN at
    step 0: an optimizer event naming covar.weight and eps."""
    ev, bundle = fire(train_prs, "make_prs_reference", tmp_path, {}, adam_eps=0.0, no_pc2=True)
    assert (ev["step"], ev["phase"]) == (0, "optimizer"), ev
    rep = nanreplay_json(bundle, code=None)
    assert rep["cause"] == "optimizer", rep["cause"]
    assert "covar.weight" in rep["hint"] and "eps=0" in rep["hint"], rep["hint"]


def test_vcf_missing_calls_read_as_nan_are_an_input_event_of_the_individual(tmp_path):
    """Two './.' calls of individual 37 read as NaN and never imputed: the batch itself holds
    NaN, an input event at step 2 naming sample 5, its two missing calls, and imputation."""
    ev, bundle = fire(train_prs, "make_prs_reference", tmp_path,
                      {"nan_calls": [(37, 11), (37, 40)]})
    assert (ev["step"], ev["phase"]) == (2, "input"), ev
    rep = nanreplay_json(bundle)
    assert (rep["origin"]["phase"], rep["origin"]["samples"]) == ("input", [5]), rep["origin"]
    assert rep["cause"] == "input", rep["cause"]
    h = rep["hint"]  # (it was the generic 'check the data pipeline ... or filter them')
    assert "sample 5 at feature(s) 11, 40 (of 120)" in h and "impute" in h, h


def test_hand_written_logistic_of_a_large_score_is_precision_not_exact_arithmetic(tmp_path):
    """Raw allele counts into the score (no standardisation) and a large learning rate: by
    step 4 the scores pass 40, ``exp(eta) / (1 + exp(eta))`` rounds to 1 (in float64 too) and
    the controls' ``log(1 - p)`` is log(0). It used to read 'invalid, which exact arithmetic
    makes too: clamp'; that ratio is a sigmoid, inside (0, 1): precision, and the logits
    form of the loss."""
    ev, bundle = fire(train_prs, "make_prs_raw", tmp_path, {}, lr=0.5, hand_written=True)
    assert (ev["step"], ev["phase"], ev["module"]) == (4, "loss", "<loss>"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"]) == ("<loss>", "aten.log", "-inf"), o
    assert o["samples"] == [r for r in ALL if r != 3], o["samples"]
    assert o["source"] == line_of("nll = -(y * torch.log(p) + (1 - y) * torch.log(1 - p))"), o
    assert rep["cause"] == "precision", (rep["cause"], rep["hint"])
    h = rep["hint"]
    assert "exp(z) / (1 + exp(z))" in h and "binary_cross_entropy_with_logits" in h, h


def train_amp(out_dir, epochs: int, record: bool = True, **loss):
    """The reference PRS with forward and loss under bfloat16 autocast (Adam, lr 0.05)."""
    model = M.make_prs_reference()
    opt = torch.optim.Adam(model.parameters(), lr=5e-2)
    crit = M.CaseControlLoss(model, **loss)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory="statistical_genetics_models:make_prs_reference") \
        if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for _ in range(epochs):
            for g, y, _trait, covar, w in M.loader(*M.genotypes()):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = loss_fn(model(g, covar), y, w)
                opt.zero_grad()
                loss.backward()
                opt.step()
    return model


def test_hand_written_logistic_under_bfloat16_autocast_rounds_to_one(tmp_path):
    """The same hand-written likelihood over standardised SNPs under bfloat16 autocast: the
    head's bfloat16 score of 8 gives exp(eta) / (1 + exp(eta)) = 1.0 in bfloat16 (float32
    keeps 1 - p = 3e-4), and a control's log(1 - p) is -inf at step 8: precision, sample 7,
    named in bfloat16, and the logits form."""
    ev, bundle = fire(train_amp, tmp_path, epochs=3, hand_written=True)
    assert (ev["step"], ev["phase"]) == (8, "loss"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("<loss>", "aten.log", "-inf",
                                                               [7]), o
    assert rep["cause"] == "precision", (rep["cause"], rep["hint"])
    h = rep["hint"]
    assert "rounded to 1 in bfloat16" in h and "binary_cross_entropy_with_logits" in h, h


def test_group_lasso_of_zero_initialised_effects_is_a_backward_nan_of_the_sqrt(tmp_path):
    """A gene-wise group lasso written as sqrt(sum of squares) over SNP effects initialised
    at 0: the forward is 0, the derivative of sqrt at 0 is infinite, times 0: NaN gradients at
    step 0. The replay names SqrtBackward0 in the loss, no sample."""
    ev, bundle = fire(train_prs, "make_prs_zero", tmp_path, {}, group=1e-3)
    assert (ev["step"], ev["phase"]) == (0, "backward"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"]) == ("<loss>", "SqrtBackward0", []), o
    assert o["source"] == line_of(
        "loss = loss + self.group * torch.sqrt(genes.pow(2).sum(1)).sum()"), o
    assert rep["cause"] == "invalid" and "vector_norm" in rep["hint"], rep["hint"]


def test_raw_variance_components_stepped_below_zero_name_the_parameters(tmp_path):
    """REML with the variances as raw parameters and a trait in small units: step 1's SGD
    update takes both below 0 and step 2's Cholesky of s_g K + s_e I fails. The hint used to
    blame a Hessian's negative curvature (iLQR, Levenberg-Marquardt); it names s_g and s_e,
    negative, and a positive parameterisation."""
    with pytest.raises(torch.linalg.LinAlgError):
        train_reml("make_reml_raw", tmp_path)
    (bundle,) = tmp_path.glob("*.nan")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["event"]["step"], o["module"], o["op"], o["made"]) == (
        2, "", "aten.linalg_cholesky_ex", "LinAlgError"), (rep["event"], o)
    assert o["source"] == line_of("return torch.linalg.cholesky(V), s_g, s_e"), o
    assert rep["cause"] == "invalid", rep["cause"]
    h = rep["hint"]
    assert "s_e = -0.137, s_g = -0.0899" in h and "exp(log_s)" in h, h
    assert "Levenberg" not in h, h


def test_log_variances_of_a_trait_in_other_units_overflow_their_exp(tmp_path):
    """The log-variance parameterisation, but the trait 100x its standardised scale (a
    phenotype never standardised): step 0's gradient sends log s to thousands, and step 1's
    exp overflows before the Cholesky refuses the infinite matrix. The replay names that exp
    in the root's forward, overflow, and the weight jump before it."""
    with pytest.raises(torch.linalg.LinAlgError):
        train_reml("make_reml_log", tmp_path, scale=100.0)
    (bundle,) = tmp_path.glob("*.nan")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["event"]["step"], o["module"], o["op"], o["made"]) == (
        1, "", "aten.exp", "+inf"), (rep["event"], o)
    assert o["source"] == line_of("s_g, s_e = (self.s_g.exp(), self.s_e.exp())"), o
    assert rep["cause"] == "overflow" and "weights had jumped" in rep["hint"], rep["hint"]


def test_batch_of_relatives_all_weighted_zero_is_a_zero_over_zero_of_the_weights(tmp_path):
    """A kinship filter excluded individuals 32-47 by a sample weight of 0, and step 2's
    batch holds only them: the weighted mean (w * nll).sum() / w.sum() is 0/0. The replay
    names that division in the loss, no row, and a divisor 0 for the whole batch."""
    ev, bundle = fire(train_prs, "make_prs_reference", tmp_path, {"related": (32, 48)})
    assert (ev["step"], ev["phase"]) == (2, "loss"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("<loss>", "aten.div", "nan", []), o
    assert o["source"] == line_of("loss = (w * nll).sum() / w.sum()"), o
    assert rep["cause"] == "invalid" and "one 0-d value for every element" in rep["hint"], \
        rep["hint"]


def test_admixture_likelihood_as_a_product_over_snps_underflows(tmp_path):
    """Neural ADMIXTURE's binomial likelihood as a product over 120 SNPs: about 1e-55, 0 in
    float32, and its log -inf at step 0: underflow, sum the logs."""
    ev, bundle = fire(train_admixture, tmp_path, product=True)
    assert (ev["step"], ev["phase"]) == (0, "loss"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("<loss>", "aten.log", "-inf",
                                                               ALL), o
    assert o["source"] == line_of("return -torch.log(lik).mean()"), o
    assert rep["cause"] == "underflow" and "sum the factors' logs" in rep["hint"], rep["hint"]


def _same_training(recorded, plain):
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.isfinite(a).all() and torch.equal(a, b), name


def test_healthy_pipelines_raise_no_event_and_train_bit_identically(tmp_path):
    """Reference frequencies with a MAF filter, log-variances, the library's logistic loss
    under bfloat16 autocast, the likelihood as a sum of logs: no event, and each trains
    bit-identically with and without the recorder."""
    _same_training(train_prs("make_prs_reference", tmp_path, {}),
                   train_prs("make_prs_reference", tmp_path, {}, record=False))
    _same_training(train_reml("make_reml_log", tmp_path), train_reml("make_reml_log", tmp_path,
                                                                     record=False))
    _same_training(train_amp(tmp_path, epochs=3), train_amp(tmp_path, epochs=3, record=False))
    _same_training(train_admixture(tmp_path, product=False),
                   train_admixture(tmp_path, product=False, record=False))
    assert not list(tmp_path.glob("*.nan"))
