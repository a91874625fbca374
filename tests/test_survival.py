"""Survival models trained as DeepSurv, pycox and torchsurv train them (``survival_models``):
hand-written Cox partial likelihoods over the batch sorted by follow-up time, censoring
masks, DeepHit's pmf over time bins, Weibull AFT heads of log-parameters; a planted bug, the
recorder on the loop, then ``nanreplay`` on the bundle."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import survival_models as S
import torch
from bundles import nanreplay_json
from torch.utils.data import DataLoader, TensorDataset

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def train(out_dir: Path, make, loss_fn, x, time, event, batch_size: int = 32):
    model = getattr(S, make)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=out_dir,
                        factory=f"survival_models:{make}") as rec:
        for xb, tb, eb in DataLoader(TensorDataset(x, time, event), batch_size=batch_size):
            opt.zero_grad()
            rec.loss_fn(model(xb), tb, eb).backward()  # (a function: called through it)
            opt.step()
    return model


def test_an_overflow_in_a_time_sorted_cox_risk_set_names_the_sample_not_its_sorted_row(
        tmp_path):
    """DeepSurv's loss sorts the batch by decreasing time (``risk[order]``) and sums
    ``exp(risk)`` cumulatively; one record never normalised (row 76, features x2000) has a
    risk score of 162, whose exp overflows. The report named sample [7]: the row of the
    sorted values, a healthy patient, and so missed that this record's data is out of scale.
    It now follows the reordering back to the batch's row (12) and the hint names that
    record's data."""
    x, time, event = S.cohort()
    x[76] *= 2000
    with pytest.raises(NonFiniteError) as info:
        train(tmp_path, "make_deepsurv", S.deepsurv_loss, x, time, event)
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (2, "loss"), err.event
    order = torch.argsort(time[64:96], descending=True).tolist()
    row = 76 - 64
    assert order.index(row) != row  # (the sorted row is another sample)
    rep = nanreplay_json(err.bundle_path, "--try", f"drop={row}")
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("loss", "<loss>", "aten.exp", [row], "overflow"), json.dumps(rep, indent=1)
    assert f"sample(s) {row} of batch" in rep["hint"], rep["hint"]
    [what_if] = rep["what_if"]
    assert what_if["finite"] is True, what_if


def test_log_of_a_follow_up_time_of_0_names_the_record_not_an_eps(tmp_path):
    """A Weibull AFT likelihood takes ``log(time)``; one patient died on the day of enrolment
    (row 70, time 0). The op, row and pole were named, but the hint said to clamp log's
    input or add an eps, as for a value the model makes: the follow-up times are a loss
    target, a batched tensor the lineage did not count as the samples' records (only lists
    of per-sample targets), so the op did not read as computed from the data alone. Now
    batched targets are the samples' records too, and the hint says the record is
    degenerate: repair or drop it where the data is made."""
    x, time, event = S.cohort()
    time[70], event[70] = 0.0, 1.0
    with pytest.raises(NonFiniteError) as info:
        train(tmp_path, "make_weibull", S.weibull_nll, x, time, event)
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (2, "loss"), err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    zero = [i - 64 for i in range(64, 96) if time[i] == 0]
    assert (o["phase"], o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("loss", "<loss>", "aten.log", zero, "invalid"), json.dumps(rep, indent=1)
    assert o["source"].startswith("survival_models.py:"), o["source"]
    assert "computed from the batch's data alone" in rep["hint"], rep["hint"]
    assert "degenerate" in rep["hint"], rep["hint"]


def test_log_of_a_normal_survival_rounded_to_0_is_precision_not_a_pole(tmp_path):
    """A log-normal AFT likelihood writes a censored patient's log S(t) as
    ``log(1 - Normal(0, 1).cdf(z))``; a follow-up entered in days (2000 among values near 1)
    puts z past 8, where the cdf, ``0.5 * (1 + erf(z / √2))``, is 1.0 in float64 too. The
    report said ``invalid``, 'which exact arithmetic makes too', and to clamp log's input:
    but 1 - Φ(z) is positive for every finite z. erf was known to stay inside (-1, 1), and
    ``1 + erf`` above 0, but not ``0.5 * (1 + erf)`` below 1; now it is, so the 0 reads as
    rounding and the hint gives ``log_ndtr(−z)``."""
    x, time, event = S.cohort()
    time[70], event[70] = 2000.0, 0.0
    with pytest.raises(NonFiniteError) as info:
        train(tmp_path, "make_weibull", S.lognormal_nll, x, time, event)
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (2, "loss"), err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    days = [i - 64 for i in range(64, 96) if time[i] > 100 and event[i] == 0]
    assert (o["phase"], o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("loss", "<loss>", "aten.log", days, "precision"), json.dumps(rep, indent=1)
    assert "log_ndtr(−z)" in rep["hint"] and "normal cdf" in rep["hint"], rep["hint"]


def test_a_log_of_a_time_of_0_masked_by_torch_where_is_named_as_the_loss_log_not_overflow(
        tmp_path):
    """A Weibull likelihood as log hazard minus cumulative hazard, the log hazard kept for
    the events by ``torch.where``; a subject censored on the day of enrolment (time 0) makes
    ``log(0) = -inf`` in the masked branch, and the backward's MulBackward0 multiplies it by
    the where's 0. The node and row were named, but the cause was ``overflow`` ('a value
    overflowed ... float64 overflows too: clamp'): the saved -inf was looked for among the
    model's ops only. It is now found in the loss re-run: aten.log of 0, invalid, on the
    data alone (the record is degenerate)."""
    x, time, event = S.cohort()
    time[70], event[70] = 0.0, 0.0
    with pytest.raises(NonFiniteError) as info:
        train(tmp_path, "make_weibull", S.weibull_nll_hazard, x, time, event)
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (2, "backward"), err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    zero = [i - 64 for i in range(64, 96) if time[i] == 0]
    assert (o["phase"], o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("backward", "<loss>", "MulBackward0", zero, "invalid"), json.dumps(rep, indent=1)
    assert [c["op"] for c in o["chain"]] == ["aten.log", "MulBackward0"], o["chain"]
    assert "aten.log of 0" in rep["hint"] and "degenerate" in rep["hint"], rep["hint"]
    assert "overflow" not in rep["hint"], rep["hint"]


@pytest.mark.parametrize("loss", ["deepsurv_loss", "cox_loss_ascending"])
def test_an_underflowed_risk_set_names_the_longest_follow_up_and_its_data(tmp_path, loss):
    """The same DeepSurv loss when the out-of-scale record (row 66, features x2000) has a
    risk score of -107 and the longest follow-up of its batch: it is first in the sorted
    order, its risk set is itself, and exp(-107) underflows to 0, log(0). The sample is found
    through the sort (its row in the sorted values is 0); the hint gave log space without
    logcumsumexp, the Cox loss's own, and said nothing of the record's data, which it said
    for an overflow only: an underflow from an out-of-scale record now gets the same note.
    ``cox_loss_ascending`` sorts by increasing time and takes each risk set as a reverse
    cumulative sum (flip, cumsum, flip): the record is last, and the rows are followed
    through the flips too."""
    x, time, event = S.cohort()
    x[66] *= 2000
    time[66] = 50.0
    with pytest.raises(NonFiniteError) as info:
        train(tmp_path, "make_deepsurv", getattr(S, loss), x, time, event)
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (2, "loss"), err.event
    row = 66 - 64
    assert torch.argsort(time[64:96], descending=True)[0] == row != 0
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("loss", "<loss>", "aten.log", [row], "underflow"), json.dumps(rep, indent=1)
    assert "logcumsumexp" in rep["hint"], rep["hint"]
    assert f"sample(s) {row} of batch" in rep["hint"], rep["hint"]
