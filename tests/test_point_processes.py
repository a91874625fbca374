"""End to end: neural temporal point processes as their repositories write them
(``point_processes_models``: RMTPP's closed-form intensity integral, the Transformer Hawkes
Process's learned-``beta`` softplus and Monte-Carlo integral, LogNormMix's log inter-event
times), trained from padded ``DataLoader`` batches with Adam, a scheduler and gradient
clipping under the recorder until a planted bug fires, then replayed with the CLI."""

from __future__ import annotations

from pathlib import Path

import point_processes_models as M
import pytest
import torch
from bundles import line_number, nanreplay_json
from torch.utils.data import DataLoader

from recorder import FlightRecorder, NonFiniteError

LOSSES = {"make_rmtpp": M.rmtpp_loss, "make_thp": M.thp_loss,
          "make_lognormmix": M.lognormmix_loss}


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> int:
    return line_number("point_processes_models.py", text)


def loss_of(rec, factory, model, times, types, mask):
    if factory == "make_thp":
        return rec.loss_fn(model(times, types), types)
    if factory == "make_rmtpp":
        return rec.loss_fn(model(times, types, mask), types, mask)
    return rec.loss_fn(model(times, types, mask), mask)


def train(out_dir, factory: str, data, epochs: int = 1, **kw):
    """Adam with a step scheduler and gradient clipping over a padded DataLoader (4 sequences
    a batch, in order); returns the number of steps run."""
    model = getattr(M, factory)(**kw)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    loader = DataLoader(data, batch_size=4, collate_fn=M.pad_events)
    steps = 0
    with FlightRecorder(model, opt, loss_fn=LOSSES[factory], out_dir=out_dir,
                        factory=f"point_processes_models:{factory}", factory_kwargs=kw) as rec:
        for _ in range(epochs):
            for times, types, mask in loader:
                loss = loss_of(rec, factory, model, times, types, mask)
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                steps += 1
            sched.step()
    return steps


def event_of(out_dir, factory: str, data, **kw) -> NonFiniteError:
    with pytest.raises(NonFiniteError) as info:
        train(out_dir, factory, data, **kw)
    return info.value


def streams(n: int, length: int, gap: float = 1.0, seed: int = 0):
    return M.sequences(torch.Generator().manual_seed(seed), n, length, gap)


def test_rmtpp_w_at_zero_names_the_parameter_divisor_not_a_batch_statistic(tmp_path):
    # w kept >= 0 by a clamp (an intensity that never decays): Adam steps the raw w below 0
    # and the clamp makes it exactly 0, where the closed-form integral
    # (exp(v.h + b) - exp(v.h + w * dt + b)) / w is 0/0 in every row
    err = event_of(tmp_path / "clamp", "make_rmtpp", streams(8, 6, gap=3.0), epochs=10,
                   w_min=0.0)
    assert (err.event["step"], err.event["phase"]) == (12, "forward")
    # and w initialised to 0 (every scalar of a config zero-initialised), at step 0
    first = event_of(tmp_path / "init", "make_rmtpp", streams(8, 6, gap=3.0), w_init=0.0)
    assert (first.event["step"], first.event["phase"]) == (0, "forward")
    for e in (err, first):
        rep = nanreplay_json(e.bundle_path)
        o = rep["origin"]
        assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"],
                o["samples"]) == (True, "invalid", "", "aten.div", "nan", [0, 1, 2, 3]), rep
        assert o["source"] == f"point_processes_models.py:{line_of('+ (torch.exp(pred + b)')}"
        # (was: "a count, sum or statistic over the batch ... divide by count.clamp_min(1)
        # ... or skip such batches", which leaves the learned w at 0 in every batch)
        hint = rep["hint"]
        assert "the divisor is the parameter intensity_w" in hint, hint
        assert "clamp_min(1)" not in hint and "skip such batches" not in hint, hint
        assert "by construction" in hint and "limit" in hint, hint


def test_rmtpp_times_in_seconds_overflow_at_the_one_long_gap(tmp_path):
    # times left in seconds: one sequence of the third batch has a 2000 s gap, and
    # exp(v.h + w * dt + b) overflows in that row only
    bad = streams(4, 6, gap=3.0, seed=1)
    bad[2][0][3:] += 2000.0
    err = event_of(tmp_path, "make_rmtpp", streams(8, 6, gap=3.0) + bad)
    assert (err.event["step"], err.event["phase"]) == (2, "forward")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["op"], o["made"], o["samples"]) == (
        True, "overflow", "aten.exp", "+inf", [2]), rep
    assert o["source"] == f"point_processes_models.py:{line_of('+ (torch.exp(pred + b)')}"
    assert "out of scale" in rep["hint"] and "drop=2" in rep["hint"], rep["hint"]


def test_rmtpp_time_scale_of_a_batch_of_single_events_is_a_mean_of_nothing(tmp_path):
    # the loader's last batch (sequences sorted by length) holds one event per sequence: the
    # batch's mean inter-event time is the mean of no gap, 0/0
    err = event_of(tmp_path, "make_rmtpp", streams(8, 6) + streams(4, 1, seed=1),
                   batch_time_scale=True)
    assert (err.event["step"], err.event["phase"]) == (2, "forward")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["op"], o["made"], o["samples"]) == (
        True, "invalid", "aten.mean", "nan", []), rep
    assert o["source"] == f"point_processes_models.py:{line_of('gaps.mean()')}"
    assert "mean of an empty tensor" in rep["hint"] and "skip such batches" in rep["hint"], rep


def ragged_at_third_batch():
    # two batches of full sequences, then one whose rows 2 and 3 are padded
    return streams(8, 6) + streams(2, 6, seed=1) + streams(2, 4, seed=2)


def test_thp_masking_the_log_after_it_is_named_at_the_pads(tmp_path):
    # compute_event "simplified": a pad's intensity is 0 (no type selected), so
    # log(event) * mask is -inf * 0 = NaN in the padded rows (forward), and
    # torch.where(mask, log(event), 0) is finite but the log's backward divides the where's
    # 0 gradient by that 0 (backward)
    err = event_of(tmp_path / "product", "make_thp", ragged_at_third_batch(), guard="product")
    assert (err.event["step"], err.event["phase"]) == (2, "forward")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["op"], o["made"], o["samples"]) == (
        True, "invalid", "aten.log", "-inf", [2, 3]), rep
    assert o["source"] == f"point_processes_models.py:{line_of('torch.log(event) * non_pad')}"
    assert "mask's 0" in rep["hint"] and "before" in rep["hint"], rep["hint"]

    err = event_of(tmp_path / "where", "make_thp", ragged_at_third_batch(), guard="where")
    assert (err.event["step"], err.event["phase"]) == (2, "backward")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["op"], o["made"], o["samples"]) == (
        True, "invalid", "LogBackward0", "nan", [2, 3]), rep
    assert o["source"] == f"point_processes_models.py:{line_of('torch.where(non_pad_mask')}"
    assert "both branches" in rep["hint"] and "before the op" in rep["hint"], rep["hint"]


def test_lognormmix_log_of_a_simultaneous_event_is_named_through_the_gru(tmp_path):
    # feature_eps=0: two events of row 1 share a timestamp, log(dt = 0) = -inf goes into the
    # GRU, whose gates saturate (finite forward) and whose weight gradient is NaN
    dup = streams(4, 6, seed=1)
    dup[1][0][3] = dup[1][0][2]
    err = event_of(tmp_path, "make_lognormmix", streams(8, 6) + dup, feature_eps=0.0)
    assert (err.event["step"], err.event["phase"]) == (2, "backward")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["samples"]) == (
        True, "invalid", "rnn", [1]), rep
    first = o["chain"][0]
    assert (first["op"], first["made"], first["source"]) == (
        "aten.log", "-inf",
        f"point_processes_models.py:{line_of('torch.log(inter_times + self.feature_eps)')}"), o
    assert "eps added to that input is exactly 0" in rep["hint"], rep["hint"]


def test_healthy_point_processes_are_not_stopped(tmp_path):
    # the repositories' own guards: THP's 1e-9 and masked_fill before the log, ifl-tpp's
    # log(dt + 1e-8) and clamp(1e-10) over padded batches with a simultaneous event, RMTPP
    # with times in units of the mean gap; THP's attention mask is -1e9, its softplus
    # thresholds in place
    dup = streams(4, 6, seed=3)
    dup[0][0][2] = dup[0][0][1]
    data = ragged_at_third_batch() + dup
    for factory in LOSSES:
        assert train(tmp_path / factory, factory, data, epochs=2) == 8
        assert not any((tmp_path / factory).glob("*.nan"))


def test_thp_softplus_by_hand_at_both_ends_points_at_the_softplus(tmp_path):
    # compute_event without THP's 1e-9 and a sharp softplus (beta = 20): where beta * x is
    # below about -17, 1 + exp(beta * x) rounds to 1 in float32 and the softplus's intensity
    # is exactly 0, whose log in compute_event, two ops later, is -inf
    err = event_of(tmp_path / "low", "make_thp", ragged_at_third_batch(), guard="masked",
                   beta=20.0)
    assert (err.event["step"], err.event["phase"]) == (0, "forward")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["op"], o["made"], o["samples"]) == (
        True, "precision", "aten.log", "-inf", [0, 1]), rep
    assert o["source"] == f"point_processes_models.py:{line_of('event.masked_fill_(') + 1}"
    # (was: "catastrophic cancellation, as in a variance E[x²] − E[x]²", at the log's line)
    hint = rep["hint"]
    softplus = f"point_processes_models.py:{line_of('torch.log(1 + torch.exp(temp))')}"
    assert f"made at {softplus} by log(1 + x)" in hint, hint
    assert "torch.log1p(x)" in hint and "F.softplus(t, beta)" in hint, hint
    assert "variance" not in hint, hint

    # the softplus without THP's hard threshold at 20 (beta = 100): exp(beta * x) overflows
    err = event_of(tmp_path / "high", "make_thp", ragged_at_third_batch(), threshold=None,
                   beta=100.0)
    assert (err.event["step"], err.event["phase"]) == (0, "forward")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["op"], o["made"], o["source"]) == (
        True, "overflow", "aten.exp", "+inf", softplus), rep
    # (was: "subtract the row max before exp ... or compute it in float64")
    hint = rep["hint"]
    assert f"inside log(1 + exp(z)) at {softplus}: a softplus written by hand" in hint, hint
    assert "F.softplus(z)" in hint and "torch.logaddexp" in hint, hint
    assert "row max" not in hint, hint


@pytest.mark.usefixtures("validation_at_torch_default")  # (a compiled test may turn it off)
def test_lognormmix_log_prob_refusing_the_pads_zero_gaps_asks_about_the_data(tmp_path):
    # the mixture built from torch.distributions (validate_args on) without ifl-tpp's
    # clamp(1e-10): the padded rows' inter-event times are 0, outside a LogNormal's support
    with pytest.raises(ValueError) as info:
        train(tmp_path, "make_lognormmix", ragged_at_third_batch(), floor=None)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    rep = nanreplay_json(Path(notes.split("Bundle: ")[1].split(";")[0]))
    o = rep["origin"]
    assert (rep["event"]["step"], rep["reproduced"], rep["cause"]) == (2, True, "invalid"), rep
    assert "refused its value" in rep["event"]["detail"], rep["event"]
    assert (o["phase"], o["op"], o["made"], o["samples"]) == (
        "forward", "aten.mul", "0", [2, 3]), rep
    made = line_of("inter_times = torch.diff(arrival_times")
    assert o["source"] == f"point_processes_models.py:{made}", o
    # (was: "make the value satisfy it by construction (a scale through softplus or exp plus a
    # floor ...)", advice for a parameter the model makes, not for the data given to log_prob)
    hint = rep["hint"]
    assert "the batch's data alone" in hint and "torch.where(mask, x, 1)" in hint, hint
    assert "clamp_min(1e-10)" in hint and "by construction" not in hint, hint
