"""Probabilistic output heads (``dist_heads_models``: a mixture density network, a low-rank
Gaussian head, a Gumbel-softmax bottleneck) trained under the recorder with the bugs such heads have, and what
``nanreplay`` says of them."""

from __future__ import annotations

import dist_heads_models as M
import pytest
import torch
from bundles import line_number, nanreplay_json

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def _batch(g):
    x = torch.randn(8, M.IN, generator=g)
    return x, torch.stack([x[:, 0].sin(), x[:, 1] * 0.5], 1)


def _train(out_dir, model, loss_fn, factory, kwargs=None, steps=4, raises=NonFiniteError):
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(raises) as info:
        with FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=out_dir, factory=factory,
                            factory_kwargs=kwargs) as rec:
            for _ in range(steps):
                x, y = _batch(g)
                opt.zero_grad()
                rec.loss_fn(model(x), y).backward()
                opt.step()
    return info.value


def test_a_relu_cov_diag_of_a_low_rank_gaussian_is_the_division_before_the_cholesky(tmp_path):
    """``LowRankMultivariateNormal`` builds its capacitance ``I + W^T D^-1 W`` in the loss
    before validating ``cov_diag``: a ReLU's 0 there makes ``W / 0`` infinite and the
    Cholesky raises. The replay said 'unknown: given a non-finite matrix, made before the
    module call running it' (no op, no samples): the loss's own division is named now."""
    model = M.make_low_rank_head()
    g = torch.Generator().manual_seed(0)
    x, _ = _batch(g)
    with torch.no_grad():  # (the plant: the rows whose ReLU diagonal is 0 at step 0)
        zero_rows = (model(x)[2] == 0).any(1).nonzero().flatten().tolist()
    assert 0 < len(zero_rows) < 8
    _train(tmp_path, model, M.low_rank_nll, "dist_heads_models:make_low_rank_head",
           raises=torch.linalg.LinAlgError)
    (bundle,) = tmp_path.glob("*.nan")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["module"], o["op"], o["made"]) == (
        0, "loss", "<loss>", "aten.div", "+inf"), rep
    assert (rep["cause"], o["samples"]) == ("invalid", zero_rows), rep
    line = line_number("dist_heads_models.py", "LowRankMultivariateNormal(loc, factor, diag)")
    assert o["source"] == f"dist_heads_models.py:{line}", rep
    assert "by 0" in rep["hint"], rep["hint"]
    assert any("linalg_cholesky_ex raised on the +inf that aten.div made" in p
               for p in rep["problems"]), rep["problems"]


def test_a_relu_mixture_scale_is_named_at_the_relu_under_validation(tmp_path):
    """The MDN's sigma through ``F.relu``: ``Normal`` refuses the 0 scale (validation on)."""
    model = M.make_mdn("relu")
    with torch.no_grad():  # (every scale below 0 before the ReLU)
        model.log_sigma.bias.fill_(-0.5)
        model.log_sigma.weight.mul_(0.01)
    assert torch.distributions.Distribution._validate_args  # (torch's default: validation on)
    err = _train(tmp_path, model, M.mdn_nll, "dist_heads_models:make_mdn", {"sigma": "relu"},
                 raises=ValueError)
    assert "scale" in str(err)
    (bundle,) = tmp_path.glob("*.nan")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["event"]["step"], o["op"], o["made"], rep["cause"], o["samples"]) == (
        0, "aten.relu", "0", "invalid", list(range(8))), rep
    assert o["source"] == f"dist_heads_models.py:{line_number('dist_heads_models.py', 'F.relu(s)')}", rep


def test_a_healthy_mdn_trains_bit_identically_under_the_recorder(tmp_path):
    def losses(recorded):
        torch.manual_seed(0)
        model = M.make_mdn("softplus")
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        g, out = torch.Generator().manual_seed(0), []
        rec = FlightRecorder(model, opt, loss_fn=M.mdn_nll, out_dir=tmp_path) if recorded \
            else None
        with rec if rec is not None else torch.enable_grad():
            for _ in range(4):
                x, y = _batch(g)
                opt.zero_grad()
                loss = (rec.loss_fn if rec else M.mdn_nll)(model(x), y)
                loss.backward()
                opt.step()
                out.append(loss.item())
        return out

    assert losses(True) == losses(False)
    assert not list(tmp_path.glob("*.nan"))


def test_a_concrete_temperature_annealed_to_0_is_the_loops_schedule(tmp_path):
    """``RelaxedOneHotCategorical(temperature, logits).rsample()`` divides by the temperature;
    annealed to 0 (the plant: at step ``at``), every row is inf - inf. The hint said only that
    the configuration built the buffer so; the loop's schedule wrote it."""
    at = 2
    model = M.make_concrete()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=torch.nn.functional.mse_loss, out_dir=tmp_path,
                            factory="dist_heads_models:make_concrete") as rec:
            for step in range(4):
                model.temperature.fill_(max(1.0 - step / at, 0.0))
                x, _ = _batch(g)
                opt.zero_grad()
                rec.loss_fn(model(x), x).backward()
                opt.step()
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["module"], o["op"], rep["cause"]) == (
        at, "forward", "", "aten.div", "invalid"), rep
    assert o["samples"] == list(range(8)), rep
    assert "the buffer temperature, a scalar" in rep["hint"], rep["hint"]
    assert "where the schedule reached 0" in rep["hint"], rep["hint"]
