"""Targets the data pipeline delivers outside what the loss takes: a missing count coded -1
under a mean squared log error's ``log1p(target)``, a negative intensity under a Hellinger
distance's ``target.sqrt()``, a soft label holding a negative probability under
``KLDivLoss``'s ``target * log(target)``. Each is planted in one sample at step K of a small
training loop (the loss module given as ``loss_fn=`` and called directly, or a function called
as ``rec.loss_fn``); the replay names the loss's op, the sample, and the target's value as the
batch gave it with the op's domain and the fix (drop or mask the record), not an eps or a clamp,
nor the "target of 0" of a log-scaled target's advice.
"""

from __future__ import annotations

import pytest
import target_domain_models as M
import torch
from bundles import nanreplay_json, source_line
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

B, STEPS, K, ROW = 8, 5, 3, 4  # batch, steps, the step and the row of the planted target
N = B * STEPS


def regression_data(bad: float | None = None):
    """Features and positive targets (counts, prices); ``bad`` at step K's row ROW."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, M.F_IN, generator=g)
    y = torch.rand(N, 1, generator=g) * 5 + 0.5
    if bad is not None:
        y[K * B + ROW] = bad
    return x, y


def train(factory: str, crit, data, out_dir=None, through_rec=False) -> list[torch.Tensor]:
    """SGD over ``data`` in batches of B; with ``out_dir`` under a FlightRecorder given
    ``crit`` as ``loss_fn`` (called as ``rec.loss_fn`` when ``through_rec``)."""
    torch.manual_seed(0)
    model = getattr(M, factory)()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses: list[torch.Tensor] = []

    def loop(loss_fn):
        for x, y in DataLoader(TensorDataset(*data), batch_size=B):
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.detach().clone())

    if out_dir is None:
        loop(crit)
        return losses
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                        factory=f"target_domain_models:{factory}") as rec:
        loop(rec.loss_fn if through_rec else crit)
    return losses


def replayed(tmp_path, factory, crit, data, through_rec=False) -> dict:
    """The event of the planted target (step K, in the loss, at row ROW), then its replay."""
    with pytest.raises(NonFiniteError) as info:
        train(factory, crit, data, tmp_path, through_rec)
    ev = info.value.event
    assert (ev["step"], ev["phase"]) == (K, "loss"), ev
    return nanreplay_json(info.value.bundle_path)


def assert_names_the_target(rep, op, value, domain, line):
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == (
        "<loss>", op, [ROW], "invalid"), (o, rep["cause"])
    assert o["source"] == source_line("target_domain_models.py", line), o
    hint = rep["hint"]
    assert f"holds {value} at sample(s) {ROW}" in hint and "as the batch gave it" in hint, hint
    assert domain in hint, hint
    # (not the op's advice for data alone: a target of 0 to mask, a degenerate record)
    assert "a target of 0" not in hint and "degenerate" not in hint, hint
    assert "clamp_min" not in hint, hint


@pytest.mark.parametrize("through_rec", [False, True])
def test_missing_count_coded_minus_one_under_msle(tmp_path, through_rec):
    """A count filled with -1 for missing: log1p(-1) is -inf in the loss's target term."""
    rep = replayed(tmp_path, "make_regressor", M.MSLELoss(), regression_data(-1.0),
                   through_rec)
    assert_names_the_target(rep, "aten.log1p", "-1", "log1p takes values above -1",
                            "return ((torch.log1p(pred) - torch.log1p(target)) ** 2).mean()")
    assert "loss_args[1] (target) holds -1" in rep["hint"], rep["hint"]
    assert "a code for a missing target" in rep["hint"], rep["hint"]


def test_negative_measured_intensity_under_a_hellinger_function(tmp_path):
    """A background-subtracted intensity of -2.5 (no code: a fraction) under sqrt."""
    rep = replayed(tmp_path, "make_regressor", M.hellinger, regression_data(-2.5),
                   through_rec=True)
    assert_names_the_target(rep, "aten.sqrt", "-2.5", "sqrt takes values of 0 or more",
                            "return ((pred.sqrt() - target.sqrt()) ** 2).mean()")
    assert "loss_args[1] (target) holds -2.5" in rep["hint"], rep["hint"]
    assert "use a loss defined there" in rep["hint"], rep["hint"]


def test_negative_soft_label_probability_under_kl_div(tmp_path):
    """A label smoothing gone wrong: one soft label holds -0.3 in class 1 (its row still
    sums to 1); KLDivLoss's xlogy(target, target) is NaN there."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, M.F_IN, generator=g)
    soft = torch.softmax(torch.randn(N, M.C, generator=g), -1)
    soft[K * B + ROW] = torch.tensor([1.2, -0.3, 0.1])
    rep = replayed(tmp_path, "make_log_classifier", nn.KLDivLoss(reduction="batchmean"),
                   (x, soft))
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == (
        "<loss>", "aten.xlogy", [ROW], "invalid"), (o, rep["cause"])
    assert f"holds -0.3 at sample(s) {ROW} (column 1) as the batch gave it" in rep["hint"]
    assert "takes values of 0 or more" in rep["hint"], rep["hint"]
    assert "degenerate" not in rep["hint"], rep["hint"]


def test_time_major_target_names_the_sample_not_the_time_step(tmp_path):
    """A (T, B, 1) target of an LSTM without batch_first: the -1 at time step 2 of sample
    ROW is named at sample ROW (the target's rows are time steps)."""
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(STEPS, 6, B, M.F_IN, generator=g)
    ys = torch.rand(STEPS, 6, B, 1, generator=g) * 5 + 0.5
    ys[K, 2, ROW] = -1.0
    torch.manual_seed(0)
    model = M.make_seq_regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    crit = M.MSLELoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="target_domain_models:make_seq_regressor"):
            for x, y in zip(xs, ys):
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    assert (info.value.event["step"], info.value.event["phase"]) == (K, "loss")
    rep = nanreplay_json(info.value.bundle_path)
    assert_names_the_target(rep, "aten.log1p", "-1", "log1p takes values above -1",
                            "return ((torch.log1p(pred) - torch.log1p(target)) ** 2).mean()")


def test_healthy_msle_is_bit_identical_and_raises_nothing(tmp_path):
    data = regression_data()
    plain = train("make_regressor", M.MSLELoss(), data)
    recorded = train("make_regressor", M.MSLELoss(), data, tmp_path)
    assert len(plain) == len(recorded) == STEPS
    assert all(torch.equal(a, b) for a, b in zip(plain, recorded))
    assert not list(tmp_path.glob("*.nan"))
