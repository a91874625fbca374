"""End to end on neural topic models (``topic_models_models``): ProdLDA (AVITM's logistic-normal
VAE with batch-normed decoder), a Dirichlet VAE (``Dirichlet.rsample``), NVDM with a KL-annealing weight passed to ``forward``, the
embedded topic model given the normalised bags of words, trained with Adam and gradient
clipping over a DataLoader of documents. Each planted failure of the domain fires under the
recorder and is replayed with the CLI; the healthy versions raise no event and train
bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import pytest
import topic_models_models as M
import torch
from bundles import nanreplay_json, source_line
from torch.utils.data import DataLoader

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

ALL = list(range(M.BATCH))


def line_of(text: str) -> str:
    return source_line("topic_models_models.py", text)


def train(make: str, out_dir, data, plant=None, loss=None, lr: float = 2e-3, steps: int = 6,
          record: bool = True, normalise=None, per_word: bool = False, half: bool = False):
    """Adam and clipping at 2 over a DataLoader of 8 documents a batch (one epoch);
    ``plant(model)`` sets the bad condition up; ``normalise(step)``: the ETM's normalised
    bags of words of the batch (else ``bow / length``); NVDM's KL weight anneals over 4 steps."""
    model = getattr(M, make)()
    if plant is not None:
        plant(model)
    if half:  # (the model cast to float16 for speed, Adam's state with it)
        model.half()
        data = data.half()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    loader = DataLoader(data, batch_size=M.BATCH)
    torch.manual_seed(1)  # the reparameterised samples
    rec = FlightRecorder(model, opt, loss_fn=loss, out_dir=out_dir,
                         factory=f"topic_models_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None and loss is not None else loss
        for step, bow in enumerate(loader):
            if step == steps:
                break
            opt.zero_grad()
            if make == "make_prodlda":
                recon, mean, logvar = model(bow)
                value = loss_fn(recon, mean, logvar, bow, model.prior_mean, model.prior_var)
            elif make == "make_nvdm" and per_word:
                value = loss_fn(model(bow, 1.0), bow)
            elif make == "make_nvdm":
                value = loss_fn(model(bow, min(1.0, step / 4)))
            elif make.startswith("make_dvae"):
                value = loss_fn(*model(bow), bow)
            else:
                nb = normalise(step) if normalise else bow / bow.sum(1, keepdim=True)
                value = model(bow, nb)
            value.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 2.0)
            opt.step()
    return model


def fire(*args, code: int = 0, **kw):
    with pytest.raises(NonFiniteError) as info:
        train(*args, **kw)
    ev = info.value.event
    return ev, nanreplay_json(info.value.bundle_path, code=code)


def origin_of(rep):
    o = rep["origin"]
    return rep["reproduced"], rep["cause"], o["module"], o["op"], o["samples"]


def collapsed_variance(model):
    """A warm start from a run whose posterior variance collapsed: the log-variance's batch
    norm shifted to -120, where exp is 0 in float32."""
    with torch.no_grad():
        model.logvar_bn.bias.fill_(-120.0)


def test_prodlda_sqrt_of_an_underflowed_variance_names_exp_half_logvar(tmp_path):
    """AVITM's ``sigma = logvar.exp().sqrt()``: exp(-120) is 0 in float32, sqrt(0) is a finite
    0 in the forward, but its derivative is infinite: a backward-only event at the first step,
    in every document. The replay names SqrtBackward0 on that line, underflow, and the
    exponent form, exp(0.5 * logvar), instead of the generic log-space list (log_softmax,
    a Cox loss's risk sets, TRADES' KL)."""
    ev, rep = fire("make_prodlda", tmp_path, M.corpus(), collapsed_variance, M.prodlda_loss)
    assert (ev["step"], ev["phase"]) == (0, "backward"), ev
    assert origin_of(rep) == (True, "underflow", "", "SqrtBackward0", ALL), rep
    assert rep["origin"]["source"] == line_of("sigma = logvar.exp().sqrt()  # as"), rep["origin"]
    hint = rep["hint"]
    assert "sqrt(exp(x)) is exp(0.5 * x)" in hint and "torch.exp(0.5 * logvar)" in hint, hint
    assert "Cox loss" not in hint and "TRADES" not in hint, hint


def test_etm_log_of_an_underflowed_mixture_names_logsumexp(tmp_path):
    """The ETM's ``log(theta @ beta)`` without its 1e-6: word embeddings warm-started 400x
    too large make beta = softmax(rho @ alpha^T) underflow for most words, so the mixture's
    entries for words of documents 5 and 7 are subnormal and the derivative of log overflows.
    The replay names LogBackward0 on that line, underflow, and the mixture's log-space form."""
    def wide_embeddings(model):
        with torch.no_grad():
            model.rho.weight.mul_(400.0)
    ev, rep = fire("make_etm", tmp_path, M.corpus(), wide_embeddings)
    assert (ev["step"], ev["phase"]) == (0, "backward"), ev
    assert origin_of(rep) == (True, "underflow", "", "LogBackward0", [5, 7]), rep
    assert rep["origin"]["source"] == line_of("preds = torch.log(torch.mm(theta, beta))")
    hint = rep["hint"]
    assert "torch.logsumexp(log_theta[:, :, None] + log_beta[None], dim=1)" in hint, hint
    assert "Cox loss" not in hint, hint


def test_nvdm_long_document_overflows_exp_and_is_named_out_of_scale(tmp_path):
    """A document a thousand times longer than the others (a dump never split) fed as raw
    counts: the encoder's log-sigma reaches the hundreds and ``exp(logsigma)`` overflows in
    that document alone, at the second batch (row 5)."""
    ev, rep = fire("make_nvdm", tmp_path, M.corpus(long=[13]), loss=M.nvdm_loss)
    assert (ev["step"], ev["phase"]) == (1, "forward"), ev
    assert origin_of(rep) == (True, "overflow", "", "aten.exp", [5]), rep
    assert rep["origin"]["source"] == line_of("z = mu + torch.exp(logsigma)"), rep["origin"]
    assert "out of scale" in rep["hint"] and "--try drop=5" in rep["hint"], rep["hint"]


def test_nvdm_high_learning_rate_diverges_into_exp_overflow(tmp_path):
    """Adam at lr=10: the weights jump at the first steps and ``exp(logsigma)`` overflows for
    every document at step 3. The replay names the exp, every sample, overflow, and the
    divergence (lower the learning rate or clip), not the data."""
    ev, rep = fire("make_nvdm", tmp_path, M.corpus(), loss=M.nvdm_loss, lr=10.0)
    assert (ev["step"], ev["phase"]) == (3, "forward"), ev
    assert origin_of(rep) == (True, "overflow", "", "aten.exp", ALL), rep
    assert "the run was diverging" in rep["hint"], rep["hint"]
    assert "lower the learning rate" in rep["hint"], rep["hint"]


def test_nvdm_per_word_bound_of_an_empty_document_is_a_degenerate_record(tmp_path):
    """The per-word bound ``per_doc / bow.sum(1)`` trained on directly: a blank document
    (row 5 of the third batch) has length 0 and a positive KL, so x/0 = +inf in the loss."""
    ev, rep = fire("make_nvdm", tmp_path, M.corpus(empty=[21]), loss=M.per_word_loss,
                   per_word=True)
    assert (ev["step"], ev["phase"]) == (2, "loss"), ev
    assert origin_of(rep) == (True, "invalid", "<loss>", "aten.div", [5]), rep
    assert rep["origin"]["made"] == "+inf", rep["origin"]
    assert rep["origin"]["source"] == line_of("return (per_doc / bow.sum(1)).mean()")
    assert "degenerate" in rep["hint"] and "divisor > 0" in rep["hint"], rep["hint"]


def test_tfidf_of_a_word_no_document_holds_is_named_in_the_input_column(tmp_path):
    """A data pipeline's tf-idf over a vocabulary built elsewhere: word 7 (and 25, which the
    small corpus never draws) is in no document, idf = log(N / 0) = inf and tf * idf is
    0 * inf = NaN in that column of every document: an input event at the first batch."""
    data = M.corpus()
    data[:, 7] = 0
    normalised = M.tfidf(data)
    ev, rep = fire("make_etm", tmp_path, data,
                   normalise=lambda k: normalised[k * M.BATCH:(k + 1) * M.BATCH])
    assert (ev["step"], ev["phase"]) == (0, "input"), ev
    assert (rep["reproduced"], rep["cause"], rep["origin"]["samples"]) == (True, "input", ALL)
    assert "column(s) 7, 25" in rep["hint"] and "per-feature step" in rep["hint"], rep["hint"]


def test_prodlda_in_float16_with_adams_eps_names_the_optimizer(tmp_path):
    """ProdLDA cast to float16 whole, Adam's state with it: eps=1e-8 is 0 in float16, so a
    weight whose v rounded to 0 divides 0 by 0 in the first update."""
    ev, rep = fire("make_prodlda", tmp_path, M.corpus(), loss=M.prodlda_loss, half=True,
                   code=1)  # (not re-run: the bundle holds the weights after the update)
    assert (ev["step"], ev["phase"]) == (0, "optimizer"), ev
    assert rep["cause"] == "optimizer", rep
    assert "eps=1e-08 is 0 in float16" in rep["hint"] and "en1.weight" in rep["hint"], rep


def test_dirichlet_vae_learned_prior_stepped_below_0_names_the_parameter(tmp_path):
    """A Dirichlet VAE whose prior concentration is learned as is (``nn.Parameter``, used
    in ``Dirichlet(self.prior_alpha)``), Adam at lr=0.5 over three epochs: the update before
    step 6 moves entry 0 to -0.19 and the distribution's check raises. The report said
    "4 value(s) refused, from -0.19 to ..." (the whole vector the independent constraint
    checks, its positive entries too) and named no parameter; now it names entry 0 alone
    and the parameter ``prior_alpha`` as the optimizer left it, with its parametrization."""
    with pytest.raises(ValueError) as info:
        train("make_dvae_learned_prior", tmp_path, M.corpus().repeat(3, 1), loss=M.dvae_loss,
              lr=0.5, steps=18)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    rep = nanreplay_json(notes.split("Bundle: ")[1].split(";")[0])
    assert rep["event"]["step"] == 6, rep["event"]
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["param"], o["made"]) == (
        True, "invalid", "", "prior_alpha", "-0.19"), rep
    assert o["source"] == line_of("kl = q.log_prob(theta) - Dirichlet(self.prior_alpha)")
    hint = rep["hint"]
    assert "value(s) refused" not in hint and "(prior_alpha[0] = -0.19)" in hint, hint
    assert "parameter 'prior_alpha' itself" in hint and "F.softplus(raw_alpha)" in hint, hint


@pytest.mark.parametrize("make,loss", [("make_nvdm", M.nvdm_loss),
                                       ("make_prodlda", M.prodlda_loss),
                                       ("make_etm", None)])
def test_healthy_topic_models_have_no_event_and_train_bit_identically(tmp_path, make, loss):
    """Blank documents in the corpus (ProdLDA's log(recon + 1e-10), ETM's normalised bags of
    words of the non-empty ones): no event, and the same weights with and without the
    recorder."""
    empty = [] if make == "make_etm" else [3, 17]
    data = M.corpus(empty=empty)
    recorded = train(make, tmp_path, data, loss=loss)
    plain = train(make, tmp_path, data, loss=loss, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), name
