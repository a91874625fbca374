"""End to end: structural demand estimation with neural nets (``demand_estimation_models``:
logit and nested-logit market shares over products and an outside good, markets of different
sizes padded into one batch with availability masks, BLP's inversion ``log s_j - log s_0``
of the observed shares, a neural utility over characteristics and log prices, Adam), trained
under the recorder from a DataLoader until a planted bug of the domain fires, then replayed
with the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import demand_estimation_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line
from torch.utils.data import DataLoader, TensorDataset

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

BATCH = 16


def line_of(text: str) -> str:
    return source_line("demand_estimation_models.py", text)


def fit(model, opt, loss, data, nested: bool, epochs: int = 1) -> list[float]:
    """Markets from a DataLoader: shares predicted from characteristics, prices and the
    availability mask (and the nest ids), the loss given the observed shares and the mask."""
    losses = []
    ds = TensorDataset(data["x"], data["price"], data["mask"], data["nest"], data["shares"])
    for _ in range(epochs):
        for x, p, m, n, s in DataLoader(ds, batch_size=BATCH):
            opt.zero_grad()
            value = loss(model(x, p, m, n) if nested else model(x, p, m), s, m)
            value.backward()
            opt.step()
            losses.append(float(value.detach()))
    return losses


def run(tmp_path: Path, factory: str, data: dict, loss=None, recorded: bool = True,
        epochs: int = 1):
    model = getattr(M, factory)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    loss = loss if loss is not None else M.ShareNLL()
    nested = isinstance(model, M.NestedLogitDemand)
    if not recorded:
        return fit(model, opt, loss, data, nested, epochs), model
    with FlightRecorder(model, opt, loss_fn=loss, out_dir=tmp_path,
                        factory=f"demand_estimation_models:{factory}") as rec:
        return fit(model, opt, rec.loss_fn, data, nested, epochs), model


def fire(tmp_path, factory, data, step: int, phase: str, **kw) -> tuple[dict, dict]:
    with pytest.raises(NonFiniteError) as info:
        run(tmp_path, factory, data, **kw)
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (step, phase), err.event
    rep = nanreplay_json(err.bundle_path)
    assert rep["reproduced"] is True, json.dumps(rep, indent=1)
    return rep, rep["origin"]


@pytest.mark.parametrize("factory,loss", [("make_logit", None), ("make_nested", None),
                                          ("make_mean_utility", "blp")])
def test_healthy_demand_models_raise_nothing_and_train_bit_identically(tmp_path, factory, loss):
    runs = []
    for recorded in (False, True):
        torch.manual_seed(0)
        fn = M.BLPInversionLoss() if loss == "blp" else None
        losses, model = run(tmp_path, factory, M.markets(), fn, recorded, epochs=2)
        runs.append((losses, [p.detach().clone() for p in model.parameters()]))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
    assert not list(tmp_path.glob("*.nan"))


def test_zero_observed_share_in_blp_inversion_names_that_market_not_the_padded_ones(tmp_path):
    """Market 37 (the third batch's sample 5) reports a product nobody bought: its share 0
    makes BLP's ``log(s_j)`` -inf. Every padded market's padding has share 0 too, which the
    loss's ``torch.where(mask, ...)`` drops by design: only market 37 is to name."""
    data = M.markets()
    data["shares"][37, 1] = 0.0
    rep, o = fire(tmp_path, "make_mean_utility", data, 2, "loss", loss=M.BLPInversionLoss())
    assert (o["phase"], o["module"], o["op"]) == ("loss", "<loss>", "aten.log")
    assert o["source"] == line_of("delta = torch.log(shares) - torch.log(s0)")
    assert o["samples"] == [5]
    assert rep["cause"] == "invalid"
    assert "drop or repair such records" in rep["hint"]


def test_empty_nest_in_a_market_is_a_fully_masked_log_sum_exp(tmp_path):
    """Market 21 (the second batch's sample 5) sells only nest-0 products: nest 1's inclusive
    value is a log-sum-exp over nothing, -inf, and ``-inf - -inf`` follows."""
    data = M.markets()
    data["nest"][21] = 0
    rep, o = fire(tmp_path, "make_nested", data, 1, "forward")
    assert (o["module"], o["op"], o["samples"]) == ("", "aten.logsumexp", [5])
    assert o["source"] == line_of("incl = torch.logsumexp(scaled, 1)")
    assert rep["cause"] == "invalid"
    assert "every entry is -inf" in rep["hint"]
    assert "keep at least one key per row" in rep["hint"]
    # the nest ids are 0 throughout market 21 (every product in nest 0), which is no blank
    # record: nest 0 sits between nest-1 products in every other market
    assert "blank record" not in rep["hint"]


def test_naive_nested_logit_at_a_steep_nesting_parameter_overflows_exp(tmp_path):
    """``exp(v / lam)`` with ``lam = 0.05`` and utilities of raw characteristics: overflow,
    then inf / inf in the hand-written within-nest shares."""
    rep, o = fire(tmp_path, "make_nested_steep", M.markets(x_scale=5.0), 0, "forward")
    assert (o["module"], o["op"], o["samples"]) == ("", "aten.exp", [0, 1, 3, 11])
    assert o["source"] == line_of("e = torch.exp(scaled)")
    assert rep["cause"] == "overflow"
    assert "torch.logsumexp" in rep["hint"] and "torch.softmax" in rep["hint"]


def test_prices_in_levels_underflow_the_hand_written_shares(tmp_path):
    """Prices in hundreds, in levels under ``alpha * price``: ``exp(v)`` underflows to 0 and
    the likelihood's ``log`` of the share is -inf."""
    rep, o = fire(tmp_path, "make_logit_levels", M.markets(price_scale=60.0), 0, "loss")
    assert (o["module"], o["op"]) == ("<loss>", "aten.log")
    assert o["samples"] == list(range(15))
    assert o["source"] == line_of("log_pred = torch.log(torch.where(valid, pred,")
    assert rep["cause"] == "underflow"


def test_outside_share_as_one_minus_sum_loses_precision(tmp_path):
    """Large utilities of unstandardised characteristics: the outside share ``1 - sum`` of the
    inside shares rounds to 0 in float32 (1e-8 in float64): log of 0 in the likelihood."""
    rep, o = fire(tmp_path, "make_logit_levels", M.markets(x_scale=10.0), 1, "loss")
    assert (o["module"], o["op"], o["samples"]) == ("<loss>", "aten.log", [14])
    assert rep["cause"] == "precision"


def test_log_of_padded_zero_prices_is_a_backward_nan_in_the_price_coefficient(tmp_path):
    """``alpha * log(price)`` at the padding's price 0, masked to -inf afterwards: the forward
    is finite, the price coefficient's gradient ``0 * -inf`` is NaN."""
    rep, o = fire(tmp_path, "make_logit_unguarded", M.markets(), 0, "backward")
    assert (o["module"], o["op"]) == ("price_utility", "MulBackward0")
    assert o["samples"] == [0, 2, 3, 8, 10, 11, 12, 14, 15]
    assert o["source"] == line_of("return alpha * torch.log(price)")
    assert rep["cause"] == "invalid"
    assert "every such entry is padding" in rep["hint"]


def gmm_fit(model, opt, loss, data) -> list[float]:
    """The second stage of a neural IV: the mean utilities fitted to BLP's inversion by GMM
    on the instruments, one weighting matrix per batch of markets."""
    ds = TensorDataset(data["x"], data["price"], data["mask"], data["shares"], data["z"])
    losses = []
    for x, p, m, s, z in DataLoader(ds, batch_size=BATCH):
        opt.zero_grad()
        value = loss(model(x, p, m), s, m, z)
        value.backward()
        opt.step()
        losses.append(float(value.detach()))
    return losses


def test_gmm_weighting_matrix_of_an_instrument_missing_in_a_batch_is_singular(tmp_path):
    """The cost shifter was not collected for markets 32-47 (the third batch), filled with 0:
    the moments' covariance has a zero row and column, and ``torch.linalg.inv`` fails."""
    data = M.markets()
    data["z"][32:48, :, 2] = 0.0
    model, loss = M.make_mean_utility(), M.GMMLoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with pytest.raises(torch.linalg.LinAlgError):  # the user's own error, with a note
        with FlightRecorder(model, opt, loss_fn=loss, out_dir=tmp_path,
                            factory="demand_estimation_models:make_mean_utility") as rec:
            gmm_fit(model, opt, rec.loss_fn, data)
    (bundle,) = tmp_path.glob("*.nan")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["event"]["step"], rep["reproduced"]) == (2, True)
    assert (o["phase"], o["module"], o["op"]) == ("loss", "<loss>", "aten.linalg_inv_ex")
    assert o["source"] == line_of("w = torch.linalg.inv(g.T @ g / len(g))")
    assert rep["cause"] == "invalid"
    assert "singular in exact arithmetic too" in rep["hint"]


def test_healthy_gmm_raises_nothing(tmp_path):
    model, loss = M.make_mean_utility(), M.GMMLoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with FlightRecorder(model, opt, loss_fn=loss, out_dir=tmp_path,
                        factory="demand_estimation_models:make_mean_utility") as rec:
        losses = gmm_fit(model, opt, rec.loss_fn, M.markets())
    assert all(v == v for v in losses) and not list(tmp_path.glob("*.nan"))
