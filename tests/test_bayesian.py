"""Bayesian deep learning and probabilistic regression trained under the recorder as the
well-known repositories write it (``bayesian_models``), with the bugs such code has, and what
``nanreplay`` says of them."""

from __future__ import annotations

import json
from pathlib import Path

import bayesian_models as B
import pytest
import torch
from bundles import nanreplay_json

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def _line(text: str) -> str:
    lines = Path(B.__file__).read_text().splitlines()
    return f"bayesian_models.py:{next(i for i, t in enumerate(lines, 1) if text in t)}"


def _regression(step: int, scale: float = 1.0, n: int = 8, d_in: int = 4):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(n, d_in, generator=g)
    return x, x.sum(-1) * scale + 0.1 * torch.randn(n, generator=g)


def test_bayes_by_backprop_prior_kept_aside_names_its_log_in_the_backward(tmp_path):
    """Bayes by backprop with Blundell's scale-mixture prior written with densities: each
    layer keeps ``log_prior`` and ``log_posterior`` aside and the loop adds ``model.kl() / N``
    to the MSE outside ``loss_fn``. As the weights grow, a sampled weight's mixture density
    falls below float32's smallest normal number: the log prior is finite, but
    ``LogBackward0``'s 1/x is +inf (and ``ExpBackward0`` then inf * 0). The re-run
    differentiated ``loss_fn`` only, found every gradient finite and blamed gradients the
    loop wrote by hand (``not_reproduced``); now the kept values are backpropagated too and
    the node, its layer and line, and the underflow (a sum of exps) are named."""
    model = B.make_bayes_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    crit = torch.nn.MSELoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="bayesian_models:make_bayes_mlp") as rec:
            for s in range(60):
                x, y = _regression(s, scale=40.0)
                opt.zero_grad()
                loss = rec.loss_fn(model(x), y) + model.kl() / 1000
                loss.backward()
                opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (35, "backward"), err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], rep["cause"], o["samples"]) == \
        ("backward", "l2", "LogBackward0", "underflow", []), json.dumps(rep, indent=1)
    assert o["source"] == _line("return torch.log(self.pi"), o["source"]
    assert "log space" in rep["hint"] and "inside loss_fn" in rep["hint"], rep["hint"]
    assert any("l2.log_prior" in p for p in rep["problems"]), rep["problems"]


@pytest.mark.parametrize("family,edge", [("beta", 1.0), ("gamma", 0.0)])
def test_a_target_on_the_edge_of_the_likelihoods_support_is_a_degenerate_record(
        tmp_path, family, edge):
    """Beta regression of a rate with one record at exactly 1 (a rate of 100%), Gamma
    regression of an amount with one record at exactly 0 (a dry day): ``log_prob`` takes
    ``xlogy(a - 1, y)`` of the target at its pole, +-inf. The op and the sample were named,
    but the advice was to clamp the op's input (an op inside torch.distributions): only the
    learned concentration counted for "computed on data alone", though the pole is at the
    target's side of xlogy. Now the hint says the record is degenerate."""
    kw = {"family": family}
    model = B.make_beta(**kw)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=B.beta_nll, out_dir=tmp_path,
                            factory="bayesian_models:make_beta", factory_kwargs=kw) as rec:
            for s in range(6):
                x, y = _regression(s)
                y = torch.sigmoid(y) if family == "beta" else y.exp()
                if s == 3:
                    y[2] = edge
                opt.zero_grad()
                rec.loss_fn(model(x), y).backward()
                opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (3, "loss"), err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], rep["cause"], o["samples"]) == \
        ("loss", "<loss>", "aten.xlogy", "invalid", [2]), json.dumps(rep, indent=1)
    assert o["source"] == _line("return -dist.log_prob(y).mean()"), o["source"]
    assert "data alone" in rep["hint"] and "degenerate" in rep["hint"], rep["hint"]


def test_svgp_cholesky_diagonal_stepped_to_zero_names_the_parameter(tmp_path):
    """A sparse variational GP whose variational Cholesky factor is trained as it is, its
    KL taking ``log(torch.diagonal(torch.tril(self.chol)))``: Adam's first step of 0.1 takes
    the diagonal's 0.1 to 0 and the next forward's log is -inf. The hint said to clamp the
    op's input: the parameter was not named, its values having reached the log through
    ``tril``'s copy. Now copies that keep a parameter's values are followed, and the hint
    names ``chol`` and says to keep it in the op's domain by construction."""
    model = B.make_svgp()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=B.svgp_elbo, out_dir=tmp_path,
                            factory="bayesian_models:make_svgp") as rec:
            for s in range(6):
                g = torch.Generator().manual_seed(s)
                x = torch.rand(16, 2, generator=g) * 4
                y = torch.sin(x).sum(-1) + 0.1 * torch.randn(16, generator=g)
                opt.zero_grad()
                rec.loss_fn(model(x), y).backward()
                opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"], err.event["module"]) == \
        (1, "forward", ""), err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], rep["cause"], o["samples"]) == \
        ("forward", "", "aten.log", "invalid", []), json.dumps(rep, indent=1)
    assert o["source"] == _line("- 2 * torch.log(torch.diagonal(s_chol))"), o["source"]
    assert "the parameter chol" in rep["hint"] and "learn its log" in rep["hint"], rep["hint"]


def test_sparse_vd_kl_passed_to_the_loss_names_that_argument(tmp_path):
    """Sparse variational dropout's KL computed by the loop from the weights,
    ``loss_fn(out, y, model.kl())``, with ``log(theta ** 2)`` lacking the paper's 1e-8: the
    zero-initialised biases make log(0) = -inf, which the clamp to [-8, 8] hides in the
    forward, and the backward multiplies the log's infinite derivative by the clamp's 0. The
    replay holds the KL's value only: the report said the loop wrote the gradients by hand.
    Now the bundle marks the loss arguments that carried an autograd graph of their own, and
    the hint names that argument as the way the gradients came."""
    model = B.make_svdo()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=B.svdo_elbo, out_dir=tmp_path,
                            factory="bayesian_models:make_svdo") as rec:
            for s in range(4):
                x, y = _regression(s)
                opt.zero_grad()
                rec.loss_fn(model(x), y, model.kl()).backward()
                opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"], err.event["params"]) == \
        (0, "backward", ["l1.bias", "l2.bias"]), err.event
    rep = nanreplay_json(err.bundle_path, code=1)
    o = rep["origin"]
    assert (o["phase"], o["params"], rep["cause"]) == \
        ("backward", ["l1.bias", "l2.bias"], "not_reproduced"), json.dumps(rep, indent=1)
    assert "came through loss_args[2]" in rep["hint"] and "model.kl()" in rep["hint"], \
        rep["hint"]
    assert "written by the loop's own code" not in rep["hint"], rep["hint"]


def test_natural_parameter_gaussian_names_the_exp_of_its_negative_eta2(tmp_path):
    """Heteroscedastic regression in natural parameters, ``eta2 = -0.5 * exp(f)``: a record
    with a feature 100 times too large drives f to about -90 and the NLL's
    ``eta1 ** 2 / (4 * eta2)`` has a gradient beyond float32 (1/y² at a tiny y). The hint
    said the denominator was "clamped to a tiny eps": a value negative in exact arithmetic
    made from exp was not followed through the -0.5 factor. Now constant factors of either
    sign keep the mark, and the hint says the value was made by exp, to compute in log
    space."""
    model = B.make_natural()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=B.natural_nll, out_dir=tmp_path,
                            factory="bayesian_models:make_natural") as rec:
            for s in range(6):
                x, y = _regression(s)
                if s == 3:
                    x[5] *= -100.0
                opt.zero_grad()
                rec.loss_fn(model(x), y).backward()
                opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (3, "backward"), err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], rep["cause"], o["samples"]) == \
        ("backward", "<loss>", "DivBackward0", "overflow", [5]), json.dumps(rep, indent=1)
    assert o["source"] == _line("- eta1 ** 2 / (4 * eta2)"), o["source"]
    assert "made by exp" in rep["hint"] and "log space" in rep["hint"], rep["hint"]
    assert "clamped to a tiny eps" not in rep["hint"], rep["hint"]


def test_a_log_prior_kept_aside_in_a_loss_given_to_record_loss_is_named(tmp_path):
    """The Bayes-by-backprop loop without a loss_fn: the ELBO is computed inline and handed
    over with ``rec.record_loss(loss)``. A sharper prior (sigma1 = e^-4) makes every
    mixture density of a sampled weight exactly 0 in float32, and the log prior kept on the
    layer is -inf: a loss event. The report said only that the loss, which the bundle does
    not hold, was made from finite model outputs; now the forward op that made the value no
    module output carries is named, as for a loss_fn's event."""
    kw = {"neg_log_sigma1": 4.0}
    model = B.make_bayes_mlp(**kw)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, out_dir=tmp_path, factory_kwargs=kw,
                            factory="bayesian_models:make_bayes_mlp") as rec:
            for s in range(6):
                x, y = _regression(s)
                opt.zero_grad()
                loss = ((model(x) - y) ** 2).mean() + model.kl() / 1000
                rec.record_loss(loss)
                loss.backward()
                opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (1, "loss"), err.event
    rep = nanreplay_json(err.bundle_path, code=1)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], rep["cause"], o["samples"]) == \
        ("forward", "l2", "aten.log", "underflow", []), json.dumps(rep, indent=1)
    assert o["source"] == _line("return torch.log(self.pi"), o["source"]
    assert any("record_loss" in p and "no module output carries" in p
               for p in rep["problems"]), rep["problems"]


def test_vmap_deep_ensemble_names_the_record_along_the_members_batch_dim(tmp_path):
    """A deep ensemble run by ``torch.vmap`` over ``functional_call`` inside the model's
    forward (PyTorch's model-ensembling recipe), output (members, batch, 2): a record 1e4
    times out of scale overflows the variance head's exp in every member. Pins that the op is
    found through vmap's batched ops and the sample is the batch row (dim 1), not a member."""
    model = B.make_vmap_ensemble()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=B.ensemble_nll, out_dir=tmp_path,
                            factory="bayesian_models:make_vmap_ensemble") as rec:
            for s in range(6):
                x, y = _regression(s)
                if s == 3:
                    x[5] *= 1e4
                opt.zero_grad()
                rec.loss_fn(model(x), y).backward()
                opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"], err.event["module"]) == \
        (3, "forward", ""), err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], rep["cause"], o["samples"]) == \
        ("forward", "", "aten.exp", "overflow", [5]), json.dumps(rep, indent=1)
    assert o["source"] == _line("return torch.stack([mean, torch.exp(log_var)], -1)")
    assert "out of scale" in rep["hint"] and "drop=5" in rep["hint"], rep["hint"]
