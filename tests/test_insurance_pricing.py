"""End to end: insurance pricing as actuaries train neural GLMs (``insurance_pricing_models``:
a CANN frequency model with a ``log(exposure)`` offset under a Poisson deviance, a severity
model under a Gamma deviance, a pure-premium model under a Tweedie deviance, categorical
rating factors through embeddings, the balance correction), trained under the recorder from a
DataLoader until a planted bug of the domain fires, then replayed with the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import insurance_pricing_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line
from torch.utils.data import DataLoader, TensorDataset

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

BATCH = 64


def line_of(text: str) -> str:
    return source_line("insurance_pricing_models.py", text)


def fit(model, loss, kind: str, data, opt, rec=None, balance: bool = False) -> list[float]:
    """One epoch over ``data`` in batches of BATCH: frequency (counts, exposure offset in the
    model), severity (the policies with a claim: mean claim size weighted by the count) or
    pure premium (weighted by exposure); the losses seen."""
    call = rec.loss_fn if rec is not None else loss
    losses = []
    for xc, xcat, exposure, counts, amounts, premium in DataLoader(TensorDataset(*data),
                                                                   batch_size=BATCH):
        if kind == "frequency":
            out = model(xc, xcat, exposure)
            value = call(out, counts, torch.ones_like(counts))
        elif kind == "severity":
            claimed = counts > 0
            out = model(xc[claimed], xcat[claimed])
            value = call(out, amounts[claimed] / counts[claimed], counts[claimed])
        else:
            out = model(xc, xcat)
            value = call(out, premium, exposure)
        opt.zero_grad()
        value.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        opt.step()
        if balance:
            M.balance_correction(model, out.detach(), counts)
        losses.append(float(value.detach()))
    return losses


def fire(tmp_path: Path, factory: str, loss, kind: str, data, balance: bool = False,
         **adam) -> NonFiniteError:
    model = getattr(M, factory)()
    opt = torch.optim.Adam(model.parameters(), **{"lr": 1e-2, **adam})
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=loss, out_dir=tmp_path,
                            factory=f"insurance_pricing_models:{factory}") as rec:
            fit(model, loss, kind, data, opt, rec, balance)
    return info.value


def report(err: NonFiniteError, step: int, phase: str, code: int = 0) -> tuple[dict, dict]:
    assert (err.event["step"], err.event["phase"]) == (step, phase), err.event
    rep = nanreplay_json(err.bundle_path, code=code)
    assert rep["reproduced"] is (code == 0), json.dumps(rep, indent=1)
    return rep, rep["origin"]


@pytest.mark.parametrize("factory,loss,kind", [
    ("make_frequency", M.PoissonDevianceXlogy(), "frequency"),
    ("make_severity", M.GammaDeviance(), "severity"),
    ("make_tweedie", M.TweedieDeviance(1.5), "premium"),
])
def test_healthy_pricing_models_raise_nothing_and_train_bit_identically(
        tmp_path, factory, loss, kind):
    data = M.portfolio()
    runs = []
    for recorded in (False, True):
        model = getattr(M, factory)()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        if recorded:
            with FlightRecorder(model, opt, loss_fn=loss, out_dir=tmp_path,
                                factory=f"insurance_pricing_models:{factory}") as rec:
                losses = fit(model, loss, kind, data, opt, rec)
        else:
            losses = fit(model, loss, kind, data, opt)
        runs.append((losses, [p.detach().clone() for p in model.parameters()]))
    (plain, w0), (watched, w1) = runs
    assert plain == watched
    assert all(torch.equal(a, b) for a, b in zip(w0, w1))
    assert not list(tmp_path.glob("*.nan"))


def test_log_exposure_offset_of_a_policy_cancelled_on_day_one_names_the_policy(tmp_path):
    """A policy cancelled on its first day has exposure 0; the CANN offset ``log(exposure)``
    is -inf in the model's forward at that policy."""
    data = list(M.portfolio())
    data[2][128 + 22] = 0.0
    err = fire(tmp_path, "make_frequency", M.PoissonDevianceXlogy(), "frequency", data)
    rep, o = report(err, 2, "forward")
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == (
        "", "aten.log", "-inf", [22], "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == line_of("offset = torch.log(exposure)")
    assert "its input is the batch's own data (args[2]" in rep["hint"], rep["hint"]
    assert "add an eps" not in rep["hint"].split("An eps")[0], rep["hint"]


def test_a_poisson_deviance_masking_zero_claims_with_where_keeps_the_policies(tmp_path):
    """The Poisson unit deviance ``y log(y/mu)`` is 0 at ``y = 0``, written with
    ``torch.where(y > 0, y * log(y / mu), 0)``: the forward is finite, but log's backward at
    ``y / mu = 0`` is 0/0 at every policy without a claim (most of them). The node, line and
    rows were right, but the hint then called those policies blank records ('a camera
    intrinsic never filled ... fix or filter such records', ``--try drop=`` of most of the
    batch): dropping the claim-free policies would bias the frequency. The origin now says
    the forward had masked these entries (``masked``), and the hint says the zeros are values
    the code handles: keep the samples and make the op's input safe."""
    data = M.portfolio()
    err = fire(tmp_path, "make_frequency", M.PoissonDeviance(), "frequency", data)
    rep, o = report(err, 0, "backward")
    no_claim = [i for i in range(BATCH) if data[3][i] == 0]
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == (
        "<loss>", "LogBackward0", "nan", no_claim, "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == line_of("ylogy = torch.where(y > 0, y * torch.log(y / mu)")
    assert o["masked"] is True, o
    assert "a blank record (" not in rep["hint"] and "--try drop" not in rep["hint"], rep["hint"]
    assert "not blank records: keep those samples" in rep["hint"], rep["hint"]


def test_a_claim_of_amount_0_in_the_severity_data_is_a_bad_record(tmp_path):
    """A claim closed without payment left in the severity data: amount 0, so the Gamma
    deviance's ``log(y / mu)`` is -inf at that claim (the third policy with a claim of the
    third batch: row 2 of the rows the model saw)."""
    data = list(M.portfolio())
    claimed = torch.nonzero(data[3][128:192])[:, 0] + 128
    data[4][claimed[2]] = 0.0
    err = fire(tmp_path, "make_severity", M.GammaDeviance(), "severity", data)
    rep, o = report(err, 2, "loss")
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == (
        "<loss>", "aten.log", "-inf", [2], "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == line_of("dev = 2 * (ratio - torch.log(ratio) - 1)")
    assert "loss_args[1] is 0 everywhere in sample(s) 2" in rep["hint"], rep["hint"]
    assert "fix or filter such records" in rep["hint"], rep["hint"]


def test_a_rating_factor_never_scaled_overflows_the_severity_and_names_the_policy(tmp_path):
    """A rating factor of one policy left in raw units (25000 among values in [0, 1]): the
    severity's log link ``exp`` overflows float32 at that policy; the report names its data
    as out of scale."""
    data = list(M.portfolio())
    claimed = torch.nonzero(data[3][128:192])[:, 0] + 128
    data[0][claimed[3], 2] = 25000.0
    err = fire(tmp_path, "make_severity", M.GammaDeviance(), "severity", data)
    rep, o = report(err, 2, "forward")
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == (
        "", "aten.exp", "+inf", [3], "overflow"), json.dumps(rep, indent=1)
    assert o["source"] == line_of("return torch.exp(self.out(self.mlp(")
    assert "sample(s) 3 of args[0] reach 2.5e+04" in rep["hint"], rep["hint"]
    assert "out of scale" in rep["hint"], rep["hint"]


def test_tweedie_mu_underflow_of_an_unscaled_policy_is_underflow(tmp_path):
    """The same unscaled factor (log density 2500) in the pure premium model drives log mu
    far below -104: ``exp`` underflows to 0 and ``mu ** (1 - p)``'s derivative at 0 is
    NaN."""
    data = list(M.portfolio())
    data[0][128 + 22, 3] = 2500.0
    err = fire(tmp_path, "make_tweedie", M.TweedieDeviance(1.5), "premium", data)
    rep, o = report(err, 2, "backward")
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == (
        "<loss>", "PowBackward0", "nan", [22], "underflow"), json.dumps(rep, indent=1)
    assert o["source"] == line_of("dev = -y * mu ** (1 - p) / (1 - p)")
    assert "log space" in rep["hint"], rep["hint"]


def test_adam_without_eps_on_a_region_with_no_policy_is_the_optimizer(tmp_path):
    """The region embedding has a row for every region of the tariff, but region 5 has no
    policy in the portfolio: its gradient is always 0, and Adam with ``eps=0`` divides
    ``m / sqrt(v)`` = 0/0 there on the first update (recorded after the update, so not re-run)."""
    data = list(M.portfolio())
    data[1][:, 0] %= M.REGIONS - 1
    err = fire(tmp_path, "make_frequency", M.PoissonDevianceXlogy(), "frequency", data, eps=0)
    rep, o = report(err, 0, "optimizer", code=1)
    assert (o["params"], rep["cause"]) == (["factors.region.weight"], "optimizer"), rep
    assert "set eps > 0" in rep["hint"] and "row(s) 5 of 6" in rep["hint"], rep["hint"]


def test_balance_correction_on_a_batch_without_claims_writes_the_bias(tmp_path):
    """The balance correction run per batch: a batch of policies with no claim has
    ``sum y = 0``, so the bias is shifted by ``log(0) = -inf``; the next forward reads it."""
    data = list(M.portfolio())
    data[3][BATCH:2 * BATCH] = 0.0
    err = fire(tmp_path, "make_frequency", M.PoissonDevianceXlogy(), "frequency", data,
               balance=True)
    rep, o = report(err, 2, "weights")
    assert (o["module"], o["params"], rep["cause"]) == ("out", ["out.bias"], "weights"), rep
    assert "the loop wrote it between that update and step 2" in rep["hint"], rep["hint"]


def test_a_learned_tweedie_power_clamped_at_a_bound_float32_rounds_names_the_bound(tmp_path):
    """The Tweedie power is learned, started at the Poisson end (1.0), and the deviance keeps
    it inside (1, 2) with ``p.clamp(1 + 1e-8, 2 - 1e-8)``: 1 + 1e-8 is 1.0 in float32, so
    ``1 - p`` is 0 and ``y mu^(1-p) / (1 - p)`` is x/0 (0/0 at the policies without a claim).
    The op, rows and cause were right (float64 has -1e-8 there), but the hint only spoke of
    catastrophic cancellation and 'clamp to the domain before the op', which the code does. A
    clamp bound rounded onto an edge was known only inside (-1, 1) (acos's), and only where
    the op took the clamped value itself; it is now any integer edge, followed through a
    shift by a number (``1 - p``), and the hint names the bound and the eps float32 keeps
    (instead of the generic advice)."""
    data = M.portfolio()
    err = fire(tmp_path, "make_tweedie_power", M.TweedieDeviance(), "premium", data)
    rep, o = report(err, 0, "loss")
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == (
        "<loss>", "aten.div", "nan", list(range(BATCH)), "precision"), json.dumps(rep, indent=1)
    assert o["source"] == line_of("dev = -y * mu ** (1 - p) / (1 - p)")
    assert "its bound 1.00000001 is 1 in float32" in rep["hint"], rep["hint"]
    assert "1 + eps with eps of at least 1.19e-07" in rep["hint"], rep["hint"]
    assert "clamp to the domain" not in rep["hint"], rep["hint"]


def test_a_severity_batch_without_any_claim_is_a_0_over_0_of_the_weights(tmp_path):
    """A batch of 64 policies none of which claimed: the severity model runs on no rows, and
    the weighted mean ``(w * dev).sum() / w.sum()`` is 0/0; no row is to blame."""
    data = list(M.portfolio())
    data[3][BATCH:2 * BATCH] = 0.0
    err = fire(tmp_path, "make_severity", M.GammaDeviance(), "severity", data)
    rep, o = report(err, 1, "loss")
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == (
        "<loss>", "aten.div", "nan", [], "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == line_of("weight.sum()  # mean over the claims")
    assert "no row is to blame" in rep["hint"] and "skip such batches" in rep["hint"], rep


def test_a_negative_unscaled_factor_underflows_mu_and_y_over_mu_names_the_policy(tmp_path):
    """A rating factor left unscaled with the other sign (-25000): ``exp`` of the severity's
    linear predictor underflows to 0 and the Gamma deviance's ``y / mu`` is +inf."""
    data = list(M.portfolio())
    claimed = torch.nonzero(data[3][128:192])[:, 0] + 128
    data[0][claimed[3], 2] = -25000.0
    err = fire(tmp_path, "make_severity", M.GammaDeviance(), "severity", data)
    rep, o = report(err, 2, "loss")
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == (
        "<loss>", "aten.div", "+inf", [3], "underflow"), json.dumps(rep, indent=1)
    assert o["source"] == line_of("ratio = y / mu")
    assert "sample(s) 3 of args[0] reach 2.5e+04" in rep["hint"], rep["hint"]


def test_a_driver_age_left_missing_is_the_input(tmp_path):
    """A policy whose driver age was never imputed (NaN after the min-max scaling)."""
    data = list(M.portfolio())
    data[0][128 + 22, 0] = float("nan")
    err = fire(tmp_path, "make_frequency", M.PoissonDevianceXlogy(), "frequency", data)
    rep, o = report(err, 2, "input")
    assert (o["tensor"], o["samples"], rep["cause"]) == ("args[0]", [22], "input"), rep


@pytest.mark.parametrize("loss,node,line", [
    ("PoissonDevianceNanToNum", "LogBackward0", "torch.nan_to_num(y * torch.log(y / mu))"),
    ("PoissonDevianceXlogyRatio", "XlogyBackward0", "torch.xlogy(y, y / mu) - y + mu"),
])
def test_other_poisson_deviances_of_zero_claims_keep_the_policies(tmp_path, loss, node, line):
    """Two more ways to write ``y log(y/mu)`` at ``y = 0``: ``nan_to_num`` of its forward
    NaN (the node's incoming gradient is 0 there: the masked case above), and
    ``xlogy(y, y / mu)``, finite in the forward, whose gradient for its second argument,
    ``x / y``, is 0/0 at every claim-free policy. The xlogy hint said 'y is something the
    model makes ... keep it off 0 (clamp_(min=eps))' and then called the policies blank
    records to filter; y / mu is 0 exactly where the data is, so the hint now says to split
    the log, xlogy(y, y) - y * log(mu), and keeps the samples."""
    data = M.portfolio()
    err = fire(tmp_path, "make_frequency", getattr(M, loss)(), "frequency", data)
    rep, o = report(err, 0, "backward")
    no_claim = [i for i in range(BATCH) if data[3][i] == 0]
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == (
        "<loss>", node, "nan", no_claim, "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == line_of(line)
    assert "a blank record (" not in rep["hint"] and "--try drop" not in rep["hint"], rep
    assert "keep those samples" in rep["hint"], rep["hint"]
    if node == "XlogyBackward0":
        assert "xlogy(x, x) - x * log(m)" in rep["hint"], rep["hint"]
        assert "clamp_(min=eps)" not in rep["hint"], rep["hint"]


def fit_accumulated(data, rec_dir: Path | None, accum: int = 2):
    """The frequency model under bfloat16 autocast, NAdam, gradients accumulated over
    ``accum`` batches of 32; the losses and final weights (``rec_dir``: under the recorder)."""
    model, loss = M.make_frequency(), M.PoissonDevianceXlogy()
    opt = torch.optim.NAdam(model.parameters(), lr=1e-2)
    losses = []

    def epoch(call):
        batches = DataLoader(TensorDataset(*data), batch_size=32)
        for i, (xc, xcat, exposure, counts, _, _) in enumerate(batches):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                value = call(model(xc, xcat, exposure), counts, torch.ones_like(counts)) / accum
            value.backward()
            losses.append(float(value.detach()))
            if i % accum == accum - 1:
                opt.step()
                opt.zero_grad()

    if rec_dir is None:
        epoch(loss)
    else:
        with FlightRecorder(model, opt, loss_fn=loss, out_dir=rec_dir,
                            factory="insurance_pricing_models:make_frequency") as rec:
            epoch(rec.loss_fn)
    return losses, [p.detach().clone() for p in model.parameters()]


def test_bf16_accumulated_frequency_is_bit_identical_and_names_the_micro_batch(tmp_path):
    """Healthy, the bf16-autocast run with accumulation trains the same with the recorder;
    a policy of exposure 0 in the second batch of step 1 (row 100 = 3 * 32 + 4) is named in
    its micro-batch."""
    data = list(M.portfolio())
    (plain, w0), (watched, w1) = fit_accumulated(data, None), fit_accumulated(data, tmp_path)
    assert plain == watched and all(torch.equal(a, b) for a, b in zip(w0, w1))
    assert not list(tmp_path.glob("*.nan"))
    data[2][100] = 0.0
    with pytest.raises(NonFiniteError) as info:
        fit_accumulated(data, tmp_path / "bad")
    rep, o = report(info.value, 1, "forward")
    assert (o["micro_batch"], o["op"], o["made"], o["samples"], rep["cause"]) == (
        1, "aten.log", "-inf", [4], "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == line_of("offset = torch.log(exposure)")
