"""Recommenders, tabular and time-series models trained as their users write them (weighted
multi-table ``EmbeddingBag``s, series with missing readings as NaN under ``allow_nan``), with
a planted bug: the recorder and ``nanreplay --json`` name the module, op, step, samples and
cause, and the hint leads to the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import recsys_models as R
import torch
from bundles import nanreplay_json

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def dlrm_batch(step: int, n: int = 16):
    """Dense features, then per table: ids, offsets (one per sample) and per-id weights; the
    tables' bags hold 1-2, 1-4 and 1-6 ids, so their flat tensors differ in length."""
    g = torch.Generator().manual_seed(step)
    dense = torch.randn(n, 4, generator=g)
    ids, offsets, weights = [], [], []
    for t, rows in enumerate((100, 50, 30)):
        lengths = torch.randint(1, 3 + 2 * t, (n,), generator=g)
        ids.append(torch.randint(0, rows, (int(lengths.sum()),), generator=g))
        offsets.append(torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]]))
        weights.append(torch.rand(int(lengths.sum()), generator=g))
    return dense, ids, offsets, weights, (dense[:, 0] > 0).float()


@pytest.mark.parametrize("table", [1, 2])
def test_a_bag_of_a_later_table_is_named_through_its_own_offsets(tmp_path, table):
    """A weighted feature's weight is +inf in bag 13 of table 1 or 2 (a dwell time divided by
    a zero duration). Every flat tensor was mapped to bags through the first offsets found,
    table 0's, so the event and the report named bag 15 (the row lies past table 0's last
    offset), and ``--try drop=13`` cut table 0's bag only and stayed non-finite. Each table's
    ids and weights are bagged by their own offsets now."""
    model = R.make_dlrm()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    crit = torch.nn.BCEWithLogitsLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="recsys_models:make_dlrm"):
            for step in range(6):
                dense, ids, offsets, weights, y = dlrm_batch(step)
                if step == 4:
                    weights[table][offsets[table][13]] = float("inf")
                opt.zero_grad()
                crit(model(dense, ids, offsets, weights), y).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["tensor"], ev["samples"]) == \
        (4, "input", f"args[3][{table}]", [13]), ev
    rep = nanreplay_json(info.value.bundle_path, "--try", "drop=13", "--try", "drop=12")
    o = rep["origin"]
    assert (o["phase"], o["tensor"], o["samples"], rep["cause"]) == \
        ("input", f"args[3][{table}]", [13], "input"), o
    tries = {t["try"]: t["finite"] for t in rep["what_if"]}
    assert tries == {"drop=13": True, "drop=12": False}, rep["what_if"]


def test_a_missing_reading_masked_after_the_affine_is_named_as_the_input(tmp_path):
    """Series with missing readings as NaN (``allow_nan``): the model standardises each
    series by its observed mean and std, applies a learned affine, and zeroes the missing
    steps only then. The forward is finite, but the affine weight's gradient multiplies the
    NaN it saved: a backward event at step 3, when series 4 first has a gap. The replay said
    ``invalid``, 'the op ran outside its domain (sqrt or log of a negative, 0/0)', naming no
    sample; no op made that NaN, the missing readings of the allowed input did: ``input``,
    the rows holding them, and impute before use."""
    model = R.make_masked_norm()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    crit = torch.nn.MSELoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path, allow_nan=["args[0]"],
                            factory="recsys_models:make_masked_norm"):
            for step in range(6):
                g = torch.Generator().manual_seed(step)
                x = torch.randn(8, 20, 2, generator=g)
                if step >= 3:
                    x[4, 15:] = float("nan")  # the sensor went offline
                opt.zero_grad()
                crit(model(x), torch.randn(8, generator=g)).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["params"]) == (3, "backward", ["weight"]), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("backward", "", "MulBackward0", [4], "input"), json.dumps(rep, indent=1)
    assert "allow_nan" in rep["hint"] and "impute batch before" in rep["hint"], rep["hint"]
    assert "outside its domain" not in rep["hint"], rep["hint"]


def test_a_rewind_window_over_sparse_gradients_applies_no_clipping_the_loop_did_not(tmp_path):
    """Matrix factorisation with ``nn.Embedding(sparse=True)`` under plain SGD, recorded with
    ``rewind=2``; a learning-rate schedule gone wrong sets 1e35 at step 4 and the dot products
    overflow at step 5. The recorder measures a sparse gradient by its stored (uncoalesced)
    values, the window's re-run measured it coalesced (ids the batch repeats summed): always
    larger, so the window 're-applied the loop's gradient clipping' the loop never did, scaled
    the re-run's gradients, and every ``--try`` then failed in torch's clip_grad_norm_, which
    refuses sparse gradients. Both norms are the recorder's measure now, and the tries clip
    sparse gradients themselves."""
    err = train_mf_with_a_schedule_gone_wrong(tmp_path, rewind=2)
    assert (err.event["step"], err.event["phase"]) == (5, "forward")
    rep = nanreplay_json(err.bundle_path, "--try", "clip=1.0", "--try", "lr=0.01")
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], rep["cause"]) == \
        ("forward", "", "aten.mul", "overflow"), o
    w = rep["window"]
    assert w["loop_clip"] is None and w["reproduced"], w
    tries = {t["try"]: t for t in rep["what_if"]}
    assert "error" not in tries["clip=1.0"] and not tries["clip=1.0"]["finite"], tries
    assert tries["lr=0.01"]["finite"], tries


def train_mf_with_a_schedule_gone_wrong(out_dir: Path, rewind=None) -> NonFiniteError:
    """Sparse matrix factorisation under SGD whose learning rate is 1e35 at step 4 (a
    schedule gone wrong): the weights are finite but huge, and step 5's dot products
    overflow."""
    model = R.make_sparse_mf()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    crit = torch.nn.MSELoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, rewind=rewind,
                            factory="recsys_models:make_sparse_mf"):
            for step in range(8):
                g = torch.Generator().manual_seed(step)
                opt.param_groups[0]["lr"] = 1e35 if step == 4 else 0.1
                users, items = torch.randint(0, 40, (32,), generator=g), \
                    torch.randint(0, 60, (32,), generator=g)
                opt.zero_grad()
                crit(model(users, items), torch.rand(32, generator=g)).backward()
                opt.step()
    return info.value


def test_an_overflow_after_a_learning_rate_jump_says_the_run_was_diverging(tmp_path):
    """The same run without a rewind window: the precursors show the learning rate jumped
    1e36x at step 4, yet the hint of step 5's overflow said only 'rescale its inputs or
    compute it in float64' (the weights' norm, squared in float32, was past its range, so no
    weight jump was seen). A learning-rate jump before the event says the run was diverging
    too, as a loss, gradient-norm or weight jump does."""
    err = train_mf_with_a_schedule_gone_wrong(tmp_path)
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["module"], o["op"], rep["cause"]) == \
        (5, "forward", "", "aten.mul", "overflow"), o
    assert any(p["kind"] == "lr_jump" and p["step"] == 4 for p in rep["precursors"])
    assert "the learning rate had jumped at step 4" in rep["hint"], rep["hint"]
    assert "the run was diverging" in rep["hint"] and "lower the learning rate" in rep["hint"]


def test_an_out_of_scale_series_is_named_beside_missing_readings(tmp_path):
    """A TCN forecaster whose series have missing readings (NaN, ``allow_nan``) under a
    Gaussian NLL of log1p counts: series 3 arrives in the wrong unit (1e4) at step 4, the
    predicted log-std follows, and exp(2 * log_std) overflows in the loss. The hint names
    out-of-scale samples of an overflow, but every row holding a missing reading counted as
    infinitely large, so series 3 stood out from nothing and the hint said only 'compute it in
    float64'. A missing value has no magnitude now: the hint names series 3 and its drop."""
    model = R.make_tcn()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    crit = R.LogGaussianNLL()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path, allow_nan=["args[0]"],
                            factory="recsys_models:make_tcn"):
            for step in range(6):
                g = torch.Generator().manual_seed(step)
                x = torch.randn(8, 2, 20, generator=g)
                x[torch.rand(8, 2, 20, generator=g) < 0.1] = float("nan")
                if step == 4:
                    x[3, 0] = 1e4  # a series in the wrong unit
                opt.zero_grad()
                crit(model(x), torch.rand(8, generator=g) * 5).backward()
                opt.step()
    assert (info.value.event["step"], info.value.event["phase"]) == (4, "loss")
    rep = nanreplay_json(info.value.bundle_path, "--try", "drop=3")
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("loss", "<loss>", "aten.exp", [3], "overflow"), json.dumps(rep, indent=1)
    assert "sample(s) 3 of batch reach" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"], rep["what_if"]


def test_drop_removes_bags_whose_offsets_end_with_the_total(tmp_path):
    """``EmbeddingBag(include_last_offset=True)``: 12 bags, 13 offsets. A +inf weight in the
    last bag is named as sample 11, but ``--try drop=11`` failed ('The size of tensor a (12)
    must match the size of tensor b (11)'): offsets one longer than the batch were not read as
    offsets, so the labels lost a row and the bags did not. They are cut as the others are."""
    model = R.make_bags_with_end()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    crit = torch.nn.MSELoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="recsys_models:make_bags_with_end"):
            for step in range(6):
                g = torch.Generator().manual_seed(step)
                lengths = torch.randint(1, 5, (12,), generator=g)
                ids = torch.randint(0, 100, (int(lengths.sum()),), generator=g)
                offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
                weights = torch.rand(len(ids), generator=g)
                if step == 4:
                    weights[offsets[11]] = float("inf")
                opt.zero_grad()
                crit(model(ids, offsets, weights), torch.randn(12, generator=g)).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["tensor"], ev["samples"]) == (4, "input", "args[2]", [11])
    rep = nanreplay_json(info.value.bundle_path, "--try", "drop=11", "--try", "drop=10")
    assert (rep["origin"]["samples"], rep["cause"]) == ([11], "input"), rep["origin"]
    tries = {t["try"]: t["finite"] for t in rep["what_if"]}
    assert tries == {"drop=11": True, "drop=10": False}, rep["what_if"]


def test_a_masked_mean_over_a_series_with_no_observed_day_names_the_division(tmp_path):
    """Daily activity with missing days as NaN (``allow_nan``), a GRU over the zero-filled
    series and a mean over the observed days: a customer with no observed day in the window
    (step 4, row 6) makes 0/0 in the root's own code, after the GRU. The recorder sees NaN
    leave the model while its input held NaN and no module made it, so it names the input;
    the replay said 'a NaN of it got past that handling: find where forward uses batch before
    imputing it'. The re-run's op finder sees the division make NaN from NaN-free values: the
    origin is that op, ``invalid``, on row 6."""
    model = R.make_pooled_gru()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    crit = torch.nn.MSELoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path, allow_nan=["args[0]"],
                            factory="recsys_models:make_pooled_gru"):
            for step in range(6):
                g = torch.Generator().manual_seed(step)
                x = torch.randn(8, 12, 3, generator=g)
                x[torch.rand(8, 12, generator=g) < 0.2] = float("nan")
                if step == 4:
                    x[6] = float("nan")  # no activity recorded in the window
                opt.zero_grad()
                crit(model(x), torch.randn(8, generator=g)).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["samples"]) == (4, "input", [6]), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("forward", "", "aten.div", [6], "invalid"), json.dumps(rep, indent=1)
    assert "0/0" in rep["hint"] and "got past" not in rep["hint"], rep["hint"]
