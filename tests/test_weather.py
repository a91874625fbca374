"""Global weather forecasting trained as FourCastNet, GraphCast and WeatherBench code trains it
(``weather_models``): states normalised per channel by statistics of the data (precipitation
as ``log(p + eps)``), a land-sea mask passed to ``forward``, an AFNO mixer, a latitude-weighted
MSE summed over the lead times of an autoregressive rollout run under ``torch.utils.checkpoint``;
the recorder on the loop, then ``nanreplay``."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import pytest
import torch
import weather_models as M
from bundles import nanreplay_json
from torch.utils.checkpoint import checkpoint

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def rollout(model, x, lsm, leads: int, ckpt: bool):
    """The forecasts of ``leads`` autoregressive steps from ``x``, each fed the last one."""
    out = []
    for _ in range(leads):
        x = checkpoint(model, x, lsm, use_reentrant=False) if ckpt else model(x, lsm)
        out.append(x)
    return out


def train_rollout(out_dir: Path, data: torch.Tensor, steps: int = 3, leads: int = 3,
                  batch: int = 4, ckpt: bool = True, **kw) -> NonFiniteError:
    """FourCastNet's fine-tuning: a loss summed over the lead times of a rollout."""
    model = M.make_forecaster(**kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    crit, lsm = M.LatWeightedMSE(), M.land_sea_mask()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="weather_models:make_forecaster", factory_kwargs=kw or None):
            for step in range(steps):
                t0 = torch.arange(batch) + step
                opt.zero_grad()
                preds = rollout(model, data[t0], lsm, leads, ckpt)
                sum(crit(p, data[t0 + k + 1]) for k, p in enumerate(preds)).backward()
                opt.step()
    return info.value


def test_negative_precipitation_fed_back_by_a_rollout_is_named_at_its_lead(tmp_path):
    """The model adds a tendency to the state in physical units, so its forecast of a dry
    cell's precipitation goes below 0; the next lead time's log(p + eps) of it is NaN, then
    every later forecast (the FFT spreads it over the grid) and every input after it. The
    report named the third lead's input, "the batch itself holds NaN", all NaN so no record of
    the data: a later micro-batch's input, which the rollout made from the event's output.
    Now the log in the normalisation of lead 1 (micro-batch 1), on the rows that went dry."""
    data = M.training_data()
    err = train_rollout(tmp_path, data)
    assert (err.event["step"], err.event["micro_batch"]) == (0, 1)
    with torch.no_grad():  # the first forecast, without the recorder: which rows went < -eps
        first = M.make_forecaster()(data[torch.arange(4)], M.land_sea_mask())
    dry = [b for b in range(4) if bool((first[b, 3] + 1e-5 < 0).any())]
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["micro_batch"], rep["cause"], o["samples"]) == \
        ("forward", "normalize", "aten.log", 1, "invalid", dry), json.dumps(rep, indent=1)
    assert o["inputs_finite"] and o["source"].startswith("weather_models.py:"), o


def test_statistics_of_the_raw_files_are_named_as_buffers_the_factory_builds(tmp_path):
    """The normalisation's mean and std come from a statistics script run on the regridded
    files, whose precipitation undershoots below 0 beside dry cells: log(p + eps) there is NaN,
    so both buffers are NaN from construction (the training pipeline clamps, so no batch is
    bad). The hint sent users to 'what writes weights outside optimizer.step() (checkpoint
    loading, in-place edits)'; it now says the factory builds the buffers so."""
    err = train_rollout(tmp_path, M.training_data(), leads=1, raw_stats=True)
    assert (err.event["step"], err.event["module"]) == (0, "normalize")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["params"], o["module"], o["op"], rep["cause"], o["samples"]) == \
        ("weights", ["normalize.mean", "normalize.std"], "normalize", "aten.sub", "weights",
         [0, 1, 2, 3]), json.dumps(rep, indent=1)
    assert rep["hint"].startswith("the factory builds buffer normalize.mean"), rep["hint"]
    assert "outside optimizer.step()" not in rep["hint"], rep["hint"]


def test_a_zero_length_mesh_edge_is_named_as_a_value_of_the_buffers_alone(tmp_path):
    """A mesh refinement added one vertex twice and joined the copies: GraphCast's edge
    feature displacement / length is 0/0 on that edge, in every sample. The hint said "add an
    eps to the denominator or skip the rows where it is 0" (rows of the batch, which holds no
    such row): the rows of the edge index buffer, ``src, dst = self.edges``, were not seen as
    made of the buffers, so neither was the division. Now it says the op's inputs were made of
    the model's buffers alone, and to fix the code that builds them."""
    model = M.make_mesh(duplicate=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    crit = torch.nn.MSELoss()
    x = torch.randn(6, 13, M.C, generator=torch.Generator().manual_seed(0))
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="weather_models:make_mesh",
                            factory_kwargs={"duplicate": True}):
            for step in range(2):
                opt.zero_grad()
                crit(model(x[step:step + 4]), x[step + 1:step + 5]).backward()
                opt.step()
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], rep["cause"], o["samples"]) == \
        ("forward", "", "aten.div", "invalid", [0, 1, 2, 3]), json.dumps(rep, indent=1)
    assert "buffers alone" in rep["hint"] and "skip the rows" not in rep["hint"], rep["hint"]


def _train_with_mask(out_dir: Path, data: torch.Tensor, lsm: torch.Tensor) -> NonFiniteError:
    """Batches of 8 states on the 8 latitude rows, the land-sea mask ``(H, W)`` passed to
    forward beside them, each step's hours in a shuffled order."""
    model = M.make_forecaster(log_channel=None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    crit = M.LatWeightedMSE()
    order = torch.tensor([3, 0, 5, 1, 7, 2, 6, 4])
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="weather_models:make_forecaster",
                            factory_kwargs={"log_channel": None}):
            for step in range(3):
                t0 = order + 9 * step
                opt.zero_grad()
                crit(model(data[t0], lsm), data[t0 + 1]).backward()
                opt.step()
    return info.value


def test_a_land_sea_mask_with_as_many_rows_as_samples_is_no_samples_own(tmp_path):
    """The (H, W) land-sea mask passed to forward has as many latitude rows as the batch has
    samples. A NaN in one hour's state was named right, but --try drop= cut a latitude row
    out of the mask too, and the re-run raised in torch.cat; a NaN in the mask (a coastal cell
    the regridding left undefined) was named as sample 3, its latitude row. The mask is now
    one field of every sample (its shape is the states' trailing shape): no sample is named,
    and a drop leaves it whole."""
    data, lsm = M.training_data(), M.land_sea_mask()
    assert lsm.shape[0] == 8
    data[9, 1, 2, 5] = float("nan")  # an hour whose file lost a value; step 1 takes it first
    t0 = torch.tensor([3, 0, 5, 1, 7, 2, 6, 4]) + 9
    bad = [int((t0 == 9).nonzero())]
    err = _train_with_mask(tmp_path / "state", data, lsm)
    assert (err.event["step"], err.event["tensor"], err.event["samples"]) == (1, "args[0]", bad)
    rep = nanreplay_json(err.bundle_path, "--try", "auto")
    assert (rep["origin"]["tensor"], rep["origin"]["samples"], rep["cause"]) == \
        ("args[0]", bad, "input"), json.dumps(rep, indent=1)
    [what_if] = rep["what_if"]
    assert what_if["try"] == f"drop={bad[0]}" and what_if["finite"] is True, what_if

    lsm = lsm.clone()
    lsm[3, 6] = float("nan")
    err = _train_with_mask(tmp_path / "mask", M.training_data(), lsm)
    assert (err.event["step"], err.event["tensor"], err.event["samples"]) == (0, "args[1]", [])
    rep = nanreplay_json(err.bundle_path)
    assert (rep["origin"]["tensor"], rep["origin"]["samples"], rep["cause"]) == \
        ("args[1]", [], "input"), json.dumps(rep, indent=1)
    assert "not per sample" in rep["hint"] and "rows [3]" not in rep["hint"], rep["hint"]


def test_a_field_missing_over_land_is_named_by_its_positions(tmp_path):
    """Sea-surface temperature is NaN over land in ERA5, in every hour: the hint named the
    columns "146, 147, 148, ..., counted past the sample dimension", flat indices into each
    state's (C, H, W). Now (channel, lat, lon) positions, and the index they all share."""
    data, lsm = M.training_data(), M.land_sea_mask()
    data[:, 1][:, lsm.bool()] = float("nan")
    err = _train_with_mask(tmp_path, data, lsm)
    assert (err.event["step"], err.event["tensor"]) == (0, "args[0]")
    rep = nanreplay_json(err.bundle_path)
    assert (rep["origin"]["samples"], rep["cause"]) == (list(range(8)), "input"), rep["origin"]
    land = [[1, *p] for p in lsm.nonzero().tolist()]
    shown = ", ".join(map(str, land[:8])) + f" (+{len(land) - 8})"
    assert f"position(s) {shown} of each sample's (4, 8, 16), all at index 1 of dim 1" \
        in rep["hint"], rep["hint"]


def _warmup_cosine(opt, warm: int = 3, total: int = 40):
    """Linear warm-up to the peak rate, then a cosine decay (FourCastNet, Pangu, GraphCast)."""
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / warm if s < warm else
                                             0.5 * (1 + math.cos(math.pi * (s - warm)
                                                                 / (total - warm))))


def _train_warmup(out_dir: Path | None):
    """Two steps of a 2-lead rollout under a warm-up to a peak rate of 3e3 (meant 3e-3), the
    loss of each lead taken as its forecast is made.
    Without ``out_dir``, no recorder: the rows whose lead-0 squared error overflows at step
    1; with it, the recorder's error."""
    model = M.make_forecaster(log_channel=None)
    opt = torch.optim.AdamW(model.parameters(), lr=3e3)
    sched, crit, lsm, data = _warmup_cosine(opt), M.LatWeightedMSE(), M.land_sea_mask(), \
        M.training_data()
    rec = contextlib.nullcontext() if out_dir is None else FlightRecorder(
        model, opt, loss_fn=crit, out_dir=out_dir, rewind=2,
        factory="weather_models:make_forecaster", factory_kwargs={"log_channel": None})
    with rec:
        for step in range(2):
            t0 = torch.arange(4) + step
            opt.zero_grad()
            x, loss = data[t0], 0
            for k in range(2):  # (each lead's loss as its forecast is made)
                x = checkpoint(model, x, lsm, use_reentrant=False)
                if out_dir is None and step == 1:
                    err = crit.w * (x - data[t0 + 1]) ** 2
                    return [b for b in range(4) if not bool(torch.isfinite(err[b]).all())]
                loss = loss + crit(x, data[t0 + k + 1])
            loss.backward()
            opt.step()
            sched.step()


def test_a_rollout_loss_that_overflowed_before_the_next_lead_is_the_origin(tmp_path):
    """After one update at a learning rate of 1e3 the first lead's forecast is ~1e20 and its
    squared error overflows float32 in the loss; the second lead's LayerNorm then overflows
    on that forecast, fed back. The recorder named the loss of micro-batch 0, as it came
    first; the replay took the forward NaN of micro-batch 1 for the origin, reported the event
    NOT reproduced, and the rewind window said it found 'not the recorded event'. Now the
    loss, reproduced, in the window too."""
    overflowed = _train_warmup(None)
    with pytest.raises(NonFiniteError) as info:
        _train_warmup(tmp_path)
    err = info.value
    assert (err.event["step"], err.event["phase"], err.event["micro_batch"]) == (1, "loss", 0)
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], o["phase"], o["module"], o["op"], o["micro_batch"],
            rep["cause"], o["samples"]) == \
        (True, "loss", "<loss>", "aten.pow", 0, "overflow", overflowed), json.dumps(rep, indent=1)
    w = rep["window"]
    first = w["first_non_finite"]
    assert w["reproduced"] and (first["phase"], first["micro_batch"]) == ("loss", 0), w


def test_a_gradient_a_later_lead_sent_into_the_forecast_is_named_in_that_lead(tmp_path):
    """Precipitation enters as its fourth root, p.clamp_min(0) ** 0.25, and the model clamps
    its precipitation forecast at 0 with a ReLU; the next lead time takes that forecast, whose
    dry cells are exactly 0, where the derivative of p ** 0.25 is infinite. The +inf flows
    back into the first lead's output, where the ReLU drops it: every parameter's gradient
    stays finite, and the recorder names the gradient entering micro-batch 0's output (it
    said "the loss from loss_fn is finite, so its backward made it"; now that micro-batch 1
    took that output as its input). The report said the loss the recorder was given re-ran finite, so "the value came from loss
    terms computed outside it" (there are none); then, once the origin was found, that it was
    finite in float64 ("precision": float64 was judged by the gradients of the parameters and
    of the outputs, not of the fed-back input). Now PowBackward0 in the second lead's
    normalisation, invalid, on the samples whose forecast holds a 0."""
    data = M.training_data()
    err = train_rollout(tmp_path, data, leads=2, ckpt=False, power=0.25)
    ev = err.event
    assert (ev["step"], ev["phase"], ev["tensor"], ev["micro_batch"], ev["params"]) == \
        (0, "backward", "grad of the model output", 0, [])
    assert "micro-batch 1 took that output as its input" in ev["detail"], ev["detail"]
    with torch.no_grad():
        first = M.make_forecaster(power=0.25)(data[torch.arange(4)], M.land_sea_mask())
    dry = [b for b in range(4) if bool((first[b, 3] == 0).any())]
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["micro_batch"], rep["cause"], o["samples"]) == \
        ("backward", "normalize", "PowBackward0", 1, "invalid", dry), json.dumps(rep, indent=1)
    assert "outside" not in rep["hint"], rep["hint"]
    assert any("micro-batch 0's output is micro-batch 1's input" in p for p in rep["problems"])


def test_a_mesh_passed_to_forward_in_a_batch_of_two_is_no_samples_own(tmp_path):
    """GraphCast trains with a batch of 1 or 2 per device. With the mesh's (2, E) edge list
    passed to forward beside (2, N, C) node states, --try drop= of the sample with a NaN cut a
    row out of the edge list too (its dim 0 has the batch's size), and the re-run raised
    ValueError in the model's `src, dst = edges`. The edge list, whose values index the
    nodes of the states, is left whole now."""
    model = M.make_mesh()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    crit = torch.nn.MSELoss()
    x = torch.randn(6, 12, M.C, generator=torch.Generator().manual_seed(0))
    x[3, 5, 1] = float("nan")  # step 1's second sample
    _, edges = M.icosphere_mesh()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="weather_models:make_mesh"):
            for step in range(3):
                b = slice(2 * step, 2 * step + 2)
                opt.zero_grad()
                crit(model(x[b], edges), x[b]).backward()
                opt.step()
    assert (info.value.event["step"], info.value.event["samples"]) == (1, [1])
    rep = nanreplay_json(info.value.bundle_path, "--try", "auto")
    assert (rep["origin"]["tensor"], rep["origin"]["samples"], rep["cause"]) == \
        ("args[0]", [1], "input"), json.dumps(rep, indent=1)
    [what_if] = rep["what_if"]
    assert what_if["try"] == "drop=1" and what_if["finite"] is True, what_if
