"""End to end: quantitative finance models as their public repositories write them
(``quant_finance_models``: a Sharpe-ratio portfolio LSTM over log returns, volatility targeting,
a Black-Scholes deep hedger, DeepLOB's rolling z-score, expected shortfall by sorting), trained
under the recorder until a planted bug of the domain fires, then replayed with the CLI."""

from __future__ import annotations

from pathlib import Path

import pytest
import quant_finance_models as M
import torch
from bundles import nanreplay_json, source_line
from torch.utils.data import DataLoader, TensorDataset

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("quant_finance_models.py", text)


def train(out_dir: Path, factory: str, loss, batches, lr: float = 1e-2) -> NonFiniteError:
    """Adam with a step schedule over ``batches`` (``(model args, loss targets)`` per step)
    under the recorder; the error its planted bug raised."""
    model = getattr(M, factory)()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=loss, out_dir=out_dir,
                            factory=f"quant_finance_models:{factory}") as rec:
            for args, targets in batches:
                loss_value = rec.loss_fn(model(*args), *targets)
                opt.zero_grad()
                loss_value.backward()
                opt.step()
                sched.step()
    return info.value


def price_paths(g, n: int = 6) -> torch.Tensor:
    """Geometric random walks of ASSETS prices: a look-back window and a holding window."""
    r = torch.randn(n, M.WINDOW + 6, M.ASSETS, generator=g) * 0.01
    return 100 * r.cumsum(1).exp()


def portfolio_batches(steps: int = 5, edit=None, tradable: bool = False):
    """(look-back prices[, tradable mask]), (holding-window returns,) per step; ``edit(step,
    look, returns, mask)`` plants the bug in place."""
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        p = price_paths(g)
        look, hold = p[:, :M.WINDOW + 1].clone(), p[:, M.WINDOW:]
        returns = hold[:, 1:] / hold[:, :-1] - 1
        mask = torch.rand(6, M.ASSETS, generator=g) > 0.3
        mask[:, 0] = True
        if edit is not None:
            edit(step, look, returns, mask)
        yield ((look, mask) if tradable else (look,)), (returns,)


def report(err: NonFiniteError, step: int, phase: str) -> tuple[dict, dict]:
    assert (err.event["step"], err.event["phase"]) == (step, phase), err.event
    rep = nanreplay_json(err.bundle_path)
    assert rep["reproduced"] is True, rep
    return rep, rep["origin"]


def test_sharpe_loss_over_a_halted_window_is_0_over_0_in_the_loss(tmp_path):
    # a suspended listing: every return of the holding window 0, so the portfolio's returns
    # are constant, std 0 and mean 0
    def halt(step, look, returns, mask):
        if step == 3:
            returns[3] = 0.0

    err = train(tmp_path, "make_portfolio", M.sharpe_loss, portfolio_batches(edit=halt))
    rep, o = report(err, 3, "loss")
    assert (rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        "invalid", "<loss>", "aten.div", "nan", [3]), rep
    assert o["source"] == line_of("sharpe = r.mean(1) / r.std(1)")
    assert "0/0" in rep["hint"] and "add an eps to the denominator" in rep["hint"], rep["hint"]


def test_log_returns_of_a_zero_price_name_the_record_not_an_eps(tmp_path):
    # a price table forward-filled from a first print of 0: from t = 3 on, asset 1 of sample 2
    # is 0, so p_4 / p_3 is 0/0 inside log(p_t / p_{t-1})
    def zero_price(step, look, returns, mask):
        if step == 2:
            look[2, 3:, 1] = 0.0

    err = train(tmp_path, "make_portfolio", M.sharpe_loss_eps,
                portfolio_batches(edit=zero_price))
    rep, o = report(err, 2, "forward")
    assert (rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        "invalid", "", "aten.div", "nan", [2]), rep
    assert o["source"] == line_of("torch.log(prices[:, 1:] / prices[:, :-1])")
    # (was: "add an eps to the denominator (std + eps, ...)": p / (0 + eps) is a made-up
    # return of 1e8 the LSTM would train on; the 0 is the record's)
    assert "the batch's own data (batch: the model's input as given" in rep["hint"], rep["hint"]
    assert "missing value filled with 0" in rep["hint"], rep["hint"]
    assert "add an eps" not in rep["hint"], rep["hint"]


def test_log_return_of_a_delisted_last_print_saved_by_the_lstm_names_the_record(tmp_path):
    # the last print of asset 2 in sample 3 is 0 (delisted): p_T / p_{T-1} is 0 and its log
    # -inf, which the LSTM's gates saturate to a finite output; its backward is NaN
    def delisted(step, look, returns, mask):
        if step == 1:
            look[3, -1, 2] = 0.0

    err = train(tmp_path, "make_portfolio", M.sharpe_loss_eps, portfolio_batches(edit=delisted))
    rep, o = report(err, 1, "backward")
    assert (rep["cause"], o["module"], o["params"], o["samples"]) == (
        "invalid", "lstm", ["lstm.weight_ih_l0"], [3]), rep
    assert o["op"].endswith("Backward0"), o  # (the LSTM kernel's node)
    made = o["chain"][0]
    assert (made["op"], made["made"], made["source"]) == (
        "aten.log", "-inf", line_of("torch.log(prices[:, 1:] / prices[:, :-1])")), o
    # (was: "clamp the op's input away from the pole (x.clamp_min(eps))", a made-up return
    # of log(eps) for a delisting; the 0 came from the record through the ratio)
    assert "aten.log of 0: its input is the batch's own data" in rep["hint"], rep["hint"]
    assert "clamp_min" not in rep["hint"], rep["hint"]


def test_volatility_targeting_of_a_flat_window_asks_for_a_vol_floor(tmp_path):
    # a halted instrument: no price change over the look-back, realised vol 0, leverage inf
    def batches():
        g = torch.Generator().manual_seed(1)
        for step in range(5):
            feats, past = torch.randn(8, 3, generator=g), torch.randn(8, 20, generator=g) * 0.01
            if step == 2:
                past[5] = 0.0
            yield (feats, past), (torch.randn(8, generator=g) * 0.01,)

    err = train(tmp_path, "make_momentum", M.strategy_loss, batches())
    rep, o = report(err, 2, "forward")
    assert (rep["cause"], o["module"], o["op"], o["samples"]) == (
        "invalid", "", "aten.div", [5]), rep
    assert o["made"] in ("+inf", "-inf"), o
    assert o["source"] == line_of("position * self.sigma_tgt / sigma_t")
    # the divisor is a statistic the code computed (std), not the record as given
    assert "add an eps to the denominator" in rep["hint"], rep["hint"]
    assert "the batch's own data" not in rep["hint"], rep["hint"]


def test_black_scholes_delta_at_expiry_is_a_backward_pole_of_the_learned_vol(tmp_path):
    # the last rebalancing date at expiry (T = 0): d1 = log(S/K) / 0 is +-inf, ncdf makes it
    # 0 or 1, finite; the gradient into the learned vol through sigma * sqrt(T) is not
    def batches():
        g = torch.Generator().manual_seed(2)
        for step in range(4):
            ttm = torch.linspace(4, 0 if step == 2 else 1, 5) / 252
            spot = (torch.randn(16, 5, generator=g) * 0.01).cumsum(1).exp()
            yield (spot, ttm), (spot,)

    err = train(tmp_path, "make_hedger", M.hedging_pnl_loss, batches())
    rep, o = report(err, 2, "backward")
    assert (rep["cause"], o["op"], o["params"], o["samples"]) == (
        "invalid", "DivBackward0", ["log_sigma"], list(range(16))), rep
    assert o["source"] == line_of("d1 = (log_moneyness + sigma ** 2")
    assert "pole" in rep["hint"] and "torch.where" in rep["hint"], rep["hint"]


def test_deeplob_zscore_of_a_halted_book_is_0_over_0_in_the_halted_sample(tmp_path):
    # the best ask of a halted instrument never moves over the window: its z-score is 0/0
    def batches():
        g = torch.Generator().manual_seed(3)
        for step in range(5):
            book = torch.randn(8, 10, 8, generator=g)
            if step == 3:
                book[4, :, 0] = 101.5
            yield (book,), (torch.randint(0, 3, (8,), generator=g),)

    err = train(tmp_path, "make_deeplob", torch.nn.functional.cross_entropy, batches())
    rep, o = report(err, 3, "forward")
    assert (rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        "invalid", "", "aten.div", "nan", [4]), rep
    assert o["source"] == line_of("return (x - mean) / (std + eps)")
    assert "add an eps to the denominator" in rep["hint"], rep["hint"]
    assert "the batch's own data" not in rep["hint"], rep["hint"]


def test_log_volume_of_an_empty_book_level_names_the_record(tmp_path):
    # the deepest ask level of sample 6 empties at t = 4: log(volume 0) is -inf
    def batches():
        g = torch.Generator().manual_seed(3)
        for step in range(4):
            book = torch.rand(8, 10, 8, generator=g) + 0.5
            if step == 2:
                book[6, 4:, 7] = 0.0
            yield (book,), (torch.randint(0, 3, (8,), generator=g),)

    err = train(tmp_path, "make_volume_lob", torch.nn.functional.cross_entropy, batches())
    rep, o = report(err, 2, "forward")
    assert (rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        "invalid", "", "aten.log", "-inf", [6]), rep
    assert o["source"] == line_of("torch.log(book[..., 1::2])")
    assert "aten.log of 0: its input is the batch's own data" in rep["hint"], rep["hint"]


def test_entropic_risk_written_out_overflows_its_exp_and_asks_for_logsumexp(tmp_path):
    # a volatile day (30% daily moves on a $100 underlying) under risk aversion 10:
    # exp(-10 * pnl) is beyond float32, though the risk itself is about -max(pnl)
    def batches():
        g = torch.Generator().manual_seed(5)
        for step in range(4):
            vol = 0.3 if step == 2 else 0.01
            spot = 100 * (torch.randn(16, 5, generator=g) * vol).cumsum(1).exp()
            yield (spot, torch.linspace(4, 1, 5) / 252), (spot,)

    err = train(tmp_path, "make_dollar_hedger", M.entropic_risk, batches())
    rep, o = report(err, 2, "loss")
    assert (rep["cause"], o["module"], o["op"], o["made"]) == (
        "overflow", "<loss>", "aten.exp", "+inf"), rep
    assert o["source"] == line_of("torch.log(torch.exp(-risk_aversion * pnl).mean())")
    # (was: "clamp the exponent ... or lower the learning rate" only, which changes the
    # objective; the log of a mean of exps is finite and logsumexp computes it)
    assert "hand-written log-sum-exp" in rep["hint"], rep["hint"]
    assert "torch.logsumexp(x, dim) - log(n)" in rep["hint"], rep["hint"]


def test_expected_shortfall_of_fewer_than_1_over_alpha_outcomes_is_an_empty_mean(tmp_path):
    # CVaR at 1% by sorting: k = int(0.01 * 60) = 0 outcomes, and the mean of none is NaN
    err = train(tmp_path, "make_portfolio", M.daily_cvar, portfolio_batches())
    rep, o = report(err, 0, "loss")
    assert (rep["cause"], o["module"], o["op"], o["made"]) == (
        "invalid", "<loss>", "aten.mean", "nan"), rep
    assert o["source"] == line_of("return worst.mean()")
    assert "empty" in rep["hint"] and "skip such batches" in rep["hint"], rep["hint"]


def test_a_day_with_no_tradable_asset_is_a_fully_masked_softmax_row(tmp_path):
    def holiday(step, look, returns, mask):
        if step == 2:
            mask[1] = False

    err = train(tmp_path, "make_masked_portfolio", M.sharpe_loss_eps,
                portfolio_batches(edit=holiday, tradable=True))
    rep, o = report(err, 2, "forward")
    assert (rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        "invalid", "", "aten._softmax", "nan", [1]), rep
    assert o["source"] == line_of("return torch.softmax(logits, dim=-1)")
    assert "fully masked row" in rep["hint"], rep["hint"]


def healthy(out_dir: Path, factory: str, loss, batches) -> None:
    """Train under the recorder with AdamW; no event, no bundle."""
    model = getattr(M, factory)()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with FlightRecorder(model, opt, loss_fn=loss, out_dir=out_dir,
                        factory=f"quant_finance_models:{factory}") as rec:
        for args, targets in batches:
            value = rec.loss_fn(model(*args), *targets)
            opt.zero_grad()
            value.backward()
            opt.step()
    assert torch.isfinite(value) and not list(out_dir.iterdir())


def test_healthy_runs_are_not_stopped(tmp_path):
    # -inf logits of untradable assets and a constant holding window under the eps'd Sharpe,
    # shuffled through a DataLoader; a hedge whose last date is before expiry: no event
    look, mask, returns = [], [], []
    for (lk, mk), (rt,) in portfolio_batches(steps=4, tradable=True):
        look.append(lk), mask.append(mk), returns.append(rt)
    returns[1][2] = 0.0
    data = TensorDataset(torch.cat(look), torch.cat(mask), torch.cat(returns))
    loader = DataLoader(data, batch_size=6, shuffle=True, generator=torch.Generator().manual_seed(0))
    healthy(tmp_path / "portfolio", "make_masked_portfolio", M.sharpe_loss_eps,
            (((lk, mk), (rt,)) for lk, mk, rt in loader))
    g = torch.Generator().manual_seed(2)
    paths = [(torch.randn(16, 5, generator=g) * 0.01).cumsum(1).exp() for _ in range(4)]
    healthy(tmp_path / "hedge", "make_hedger", M.hedging_pnl_loss,
            (((s, torch.linspace(4, 1, 5) / 252), (s,)) for s in paths))
