"""Forecasting trained as GluonTS, RevIN/PatchTST and N-BEATS code trains it
(``timeseries_models``): DeepAR's mean scaling and likelihood heads returning
``torch.distributions`` objects, missing values as NaN under observed masks, N-BEATS's losses;
a planted bug, the recorder on the loop, then ``nanreplay``."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import timeseries_models as TS
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError


def line_of(text: str) -> str:
    return source_line("timeseries_models.py", text)


# (each test starts with torch.distributions' validation on: see conftest)
pytestmark = pytest.mark.usefixtures("in_tests_dir", "validation_at_torch_default")


@contextlib.contextmanager
def validation(on: bool):
    """``torch.distributions``' default ``validate_args``, as Pyro's ``enable_validation`` and
    speed-minded training scripts set it, restored after."""
    before = torch.distributions.Distribution._validate_args
    torch.distributions.Distribution.set_default_validate_args(on)
    try:
        yield
    finally:
        torch.distributions.Distribution.set_default_validate_args(before)


def series(step: int, B: int = 8, T: int = 24, counts: bool = False):
    """(past, covariate), next values: random walks, or Poisson counts of a rate per series."""
    g = torch.Generator().manual_seed(step)
    if counts:
        x = torch.poisson((torch.rand(B, 1, generator=g) * 5 + 0.5).expand(B, T + 1),
                          generator=g)
    else:
        x = torch.randn(B, T + 1, generator=g).cumsum(1)
    return x, torch.randn(B, T, generator=g)


def train_deepar(out_dir: Path, kw: dict, edit, loss=TS.nll, **rec) -> NonFiniteError:
    """DeepAR under Adam, teacher-forced on the lagged values; ``edit(step, x)`` plants the
    bug in the batch (or returns it unchanged)."""
    model = TS.make_deepar_nb(**kw)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=loss, out_dir=out_dir, factory_kwargs=kw,
                            factory="timeseries_models:make_deepar_nb", **rec) as r:
            for step in range(8):
                x, cov = series(step, counts=kw.get("likelihood", "nb") == "nb")
                x = edit(step, x)
                opt.zero_grad()
                r.loss_fn(model(x[:, :-1], cov), x[:, 1:]).backward()
                opt.step()
    return info.value


def test_an_overflow_inside_a_distribution_output_is_a_forward_event(tmp_path):
    """DeepAR with a Student-t head: series 5 arrives in the wrong unit (~3e37) at step 4, the
    mean scaler's sum overflows to inf, and inf only reaches the distribution's ``loc`` and
    ``scale`` (the LSTM reads ``past / scale``, 0). The recorder checked no tensor of a
    ``torch.distributions`` output, so the event was the loss's ('non-finite while the model
    output is finite') and the replay blamed the log-likelihood's division 'where its inputs
    held infinities (a -inf mask)'. A distribution output is checked through its tensors: the
    forward made it, ``aten.mean`` in the scaler, on series 5, whose data is out of scale."""
    def wrong_unit(step, x):
        if step == 4:
            x[5] = 3e37 * (1 + torch.rand(25, generator=torch.Generator().manual_seed(1)))
        return x

    err = train_deepar(tmp_path, {"likelihood": "studentt"}, wrong_unit)
    ev = err.event
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"], ev["samples"]) == \
        (4, "forward", "", "+inf", [5]), ev
    rep = nanreplay_json(err.bundle_path, "--try", "drop=5")
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("forward", "", "aten.mean", [5], "overflow"), json.dumps(rep, indent=1)
    assert o["source"] == line_of("scale = past.abs().mean(1, keepdim=True)"), o["source"]
    assert "sample(s) 5 of args[0]" in rep["hint"] and "out of scale" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"], rep["what_if"]


def test_a_run_without_distribution_validation_is_replayed_without_it(tmp_path):
    """DeepAR's negative binomial head over counts, trained with validation off
    (``set_default_validate_args(False)``) and the mean scaler without its floor: a product
    with no sales yet (series 3, step 5) divides 0 by 0. The replay ran with torch's default,
    validation on: ``NegativeBinomial`` refused the NaN ``total_count`` in the re-run, and the
    report's note said the model's code raised 'as it did in training', which it never did.
    The bundle records the run's default, and the replay runs with it. (The recorder's event,
    at the root enclosing the LSTM that passed the NaN on, said kind -inf and no samples: a
    distribution output was not read; it is now, NaN on series 3.)"""
    def no_sales(step, x):
        if step == 5:
            x[3] = 0.0
        return x

    with validation(False):
        err = train_deepar(tmp_path, {"min_scale": 0.0}, no_sales)
    ev = err.event
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"], ev["samples"]) == \
        (5, "forward", "", "nan", [3]), ev
    assert torch.distributions.Distribution._validate_args  # the replay's, as by default
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("forward", "", "aten.div", [3], "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == line_of("past / scale, covariate"), o["source"]
    assert not any("raised" in p for p in rep["problems"]), rep["problems"]
    assert torch.distributions.Distribution._validate_args  # (restored after the replay)


def test_missing_readings_weighted_out_by_a_product_name_that_product(tmp_path):
    """Series with missing readings as NaN (``allow_nan``), and a mean scaler that weights
    them out as ``(past.abs() * observed).sum() / observed.sum()``: NaN * 0 is NaN, so series
    5's scale is NaN from its first gap (step 3). The report said only that a NaN 'got past
    the handling: find where forward uses args[0]' (and, with the output a distribution, the
    replay read the re-run's forward as finite). It names that product and its line now."""
    def gap(step, x):
        if step >= 3:
            x[5, 10:14] = float("nan")  # the sensor was offline
        return x

    kw = {"likelihood": "studentt", "observed_by_product": True}
    with validation(False):
        err = train_deepar(tmp_path, kw, gap, loss=TS.masked_nll, allow_nan=["args[0]"])
    ev = err.event
    assert (ev["step"], ev["phase"], ev["tensor"], ev["samples"]) == (3, "input", "args[0]", [5])
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["tensor"], o["op"], o["samples"], rep["cause"]) == \
        ("input", "args[0]", None, [5], "input"), json.dumps(rep, indent=1)
    assert o["source"] == line_of("scale = (past.abs() * observed)"), o["source"]
    assert "aten.mul" in rep["hint"] and "NaN * 0 is NaN" in rep["hint"], rep["hint"]
    assert "torch.nan_to_num" in rep["hint"], rep["hint"]


def test_missing_targets_masked_by_multiplying_name_the_product(tmp_path):
    """PatchTST (RevIN, patches, a Transformer encoder) forecasting series whose future values
    have gaps (NaN), under a masked MSE that multiplies the squared errors by the observed
    mask: NaN * 0 is NaN, and the loss target is the event. The hint said to fix the data
    pipeline, or a teacher or EMA network that computed the target: the missing values are
    meant to be there, the product kept them. The loss is re-run and the product named."""
    model = TS.make_patchtst()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=TS.masked_mse, out_dir=tmp_path,
                            factory="timeseries_models:make_patchtst") as rec:
            for step in range(6):
                g = torch.Generator().manual_seed(step)
                x = torch.randn(8, 40, 2, generator=g).cumsum(1)
                if step == 2:
                    x[torch.rand(8, 40, generator=g) < 0.05] = float("nan")
                past, future = x[:, :32], x[:, 32:]
                past = past.nan_to_num()  # the inputs are imputed, the targets are not
                opt.zero_grad()
                rec.loss_fn(model(past), future).backward()
                opt.step()
    missing = sorted(set(torch.isnan(future).any(2).any(1).nonzero().flatten().tolist()))
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["tensor"], ev["samples"]) == \
        (2, "input", "loss_args[1]", missing), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["tensor"], o["samples"], rep["cause"]) == \
        ("input", "loss_args[1]", missing, "input"), json.dumps(rep, indent=1)
    assert o["source"] == line_of("return ((forecast - target) ** 2 * observed)"), o["source"]
    assert "aten.mul" in rep["hint"] and "NaN * 0 is NaN" in rep["hint"], rep["hint"]
    assert "data pipeline" not in rep["hint"], rep["hint"]


def test_a_loss_outside_the_recorder_on_a_distribution_output_is_named_as_such(tmp_path):
    """DeepAR's Student-t head, its loss written inline in the loop (no ``loss_fn``) with
    GluonTS's ``weighted_average`` over the observed targets: series 6 has no readings for
    its last four steps at step 3, ``torch.where`` drops their NaN log-likelihood from the
    value, and its backward multiplies them (0 * NaN). The recorder kept no gradient entering
    a distribution output, so the replay said no backward reached the model and blamed 'the
    loop's own code' writing the gradients. The gradient entering the distribution's tensors
    is kept now: the report names the loss outside the recorder, on series 6, and which
    tensor of the distribution the gradient entered."""
    model = TS.make_deepar_nb(likelihood="studentt")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with validation(False), pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, out_dir=tmp_path, factory_kwargs={
                "likelihood": "studentt"}, factory="timeseries_models:make_deepar_nb"):
            for step in range(6):
                x, cov = series(step)
                y = x[:, 1:].clone()
                if step == 3:
                    y[6, 20:] = float("nan")
                opt.zero_grad()
                TS.observed_nll(model(x[:, :-1], cov), y).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"]) == (3, "backward"), ev
    missing = torch.isnan(y).any(1).nonzero().flatten().tolist()
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["op"], o["samples"], rep["cause"]) == \
        ("loss", None, missing, None), json.dumps(rep, indent=1)
    assert "gradient entering the model's output" in o["detail"], o["detail"]
    assert o["tensor"].startswith("grad of the model output (StudentT."), o["tensor"]
    assert "loss_fn=" in rep["hint"] and "loop's own code" not in rep["hint"], rep["hint"]


def test_n_beats_divide_no_nan_masks_the_value_but_not_the_gradient(tmp_path):
    """N-BEATS's sMAPE through its ``divide_no_nan`` (``result[result != result] = 0`` after
    the division), without the ``.data`` its authors put on the denominator, over
    intermittent demand with a ReLU'd forecast: where forecast and target are both 0 the
    value is 0/0 set to 0, and the division's backward is 0/0 again. Every parameter's
    gradient stays finite (the ReLU drops those entries), so the event is the gradient
    entering the forecast; the replay names the loss's DivBackward0 on the series with
    such a step (computed here from the initial model's forecast), ``invalid``."""
    model = TS.make_nbeats()
    fresh = TS.make_nbeats()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    x = torch.poisson(torch.rand(16, 1, generator=g).expand(16, 30) * 3, generator=g)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=TS.smape_2_loss, out_dir=tmp_path,
                            factory="timeseries_models:make_nbeats") as rec:
            for _ in range(3):
                opt.zero_grad()
                rec.loss_fn(model(x[:, :24]), x[:, 24:], torch.ones(16, 6)).backward()
                opt.step()
    with torch.no_grad():
        both_zero = (fresh(x[:, :24]) == 0) & (x[:, 24:] == 0)
    rows = both_zero.any(1).nonzero().flatten().tolist()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["tensor"], ev["samples"]) == \
        (0, "backward", "grad of the model output", rows), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("backward", "<loss>", "DivBackward0", rows, "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == line_of("result = a / b"), o["source"]
    assert "torch.where(mask, x, 1)" in rep["hint"], rep["hint"]


def test_masked_bins_of_a_categorical_output_are_no_event_an_all_masked_row_is(tmp_path):
    """A tokenised forecaster returns ``Categorical(logits=...)`` with the bins above each
    series' capacity masked to -inf: a probability of 0, no event, now that a distribution
    output is checked through its tensors (its logits may hold -inf as a masked tensor
    output may not). At step 3 series 2's capacity is -1 (unknown, encoded so upstream):
    every bin is masked, ``Categorical`` normalises an all -inf row to NaN (validation is
    off, as in a run that turned it off for speed), and that is the forward's event, on
    series 2."""
    model = TS.make_binned()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with validation(False), pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=TS.token_nll, out_dir=tmp_path,
                            factory="timeseries_models:make_binned") as rec:
            for step in range(6):
                g = torch.Generator().manual_seed(step)
                past = torch.rand(8, 24, generator=g) * 10
                capacity = torch.randint(8, 16, (8,), generator=g)
                token = torch.randint(0, 8, (8,), generator=g)
                if step == 3:
                    capacity[2] = -1
                opt.zero_grad()
                rec.loss_fn(model(past, capacity), token).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"], ev["samples"]) == \
        (3, "forward", "", "nan", [2]), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("forward", "", "aten.logsumexp", [2], "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == line_of("return Categorical(logits=logits.masked_fill("), o["source"]
    assert "fully masked row" in rep["hint"], rep["hint"]


def test_a_nan_target_that_validate_args_refused_in_the_loss_is_bundled(tmp_path):
    """DeepAR's Student-t head with torch's default validation: series 2's target holds a NaN
    (a gap never masked) at step 3, and ``log_prob`` raises ValueError inside ``loss_fn``.
    The recorder's loss hook never ran, so the cut-short step held nothing non-finite: no
    bundle, no note. The hook runs on the loss's exception too (``always_call``) and checks
    the call's data arguments: the ValueError goes on with the recorder's note, naming the
    target and series 2, and dropping it clears the step."""
    def gap(step, x):
        if step == 3:
            x[2, -1] = float("nan")  # the target's last step only (the model reads x[:, :-1])
        return x

    with pytest.raises(ValueError) as info:
        train_deepar(tmp_path, {"likelihood": "studentt"}, gap, loss=TS.nll)
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "at step 3, phase input" in notes and "loss_args[1], samples [2]" in notes, notes
    [bundle] = tmp_path.glob("*.nan")
    rep = nanreplay_json(bundle, "--try", "drop=2")
    o = rep["origin"]
    assert (o["phase"], o["tensor"], o["samples"], rep["cause"]) == \
        ("input", "loss_args[1]", [2], "input"), json.dumps(rep, indent=1)
    assert rep["what_if"][0]["finite"], rep["what_if"]
