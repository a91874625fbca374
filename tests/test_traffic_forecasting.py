"""End to end on traffic forecasting (``traffic_forecasting_models``): DCRNN's DCGRU
encoder-decoder over the random-walk matrices ``D^-1 A`` with scheduled sampling, Graph
WaveNet's adaptive adjacency, DCRNN's masked MAE/MAPE/RMSE with 0.0 as the missing reading,
the loaders' per-sensor z-score, a DataLoader over sliding windows, Adam with a step schedule,
a curriculum over horizons and gradient clipping. Each planted failure of the domain (an
isolated sensor, a batch with every reading missing, a NaN in the raw CSV, a stuck sensor's
zero std, a zero reading the MAPE did not mask) fires under the recorder and is replayed with
the CLI; the healthy versions raise no event and train bit-identically with and without it."""

from __future__ import annotations

import contextlib

import pytest
import torch
import traffic_forecasting_models as M
from bundles import nanreplay_json, source_line
from torch.utils.data import DataLoader, TensorDataset

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

BATCH, STEPS = 8, 4


def line_of(text: str) -> str:
    return source_line("traffic_forecasting_models.py", text)


def dataset(plant: str | None):
    """The windows of a speed series (one per sample, BATCH per step) and the scaler fitted on
    the clean series; ``plant`` breaks the series where only the last step's windows see it."""
    g = torch.Generator().manual_seed(0)
    series = M.speeds(BATCH * STEPS + M.T_IN + M.HORIZON - 1, g)
    fit = series.clone()
    s0 = BATCH * (STEPS - 1)  # the last step's first window
    if plant == "outage":  # the feed was down: every reading of the last step's targets is 0
        series[s0 + M.T_IN:] = 0.0
    elif plant == "nan_csv":  # an empty cell pandas read as NaN: windows s0..s0+6 hold it
        series[s0 + 6, 3] = float("nan")
    elif plant == "truncated":  # the CSV's last row cut short: only the last target holds it
        series[-1, 3] = float("nan")
    elif plant == "dropout":  # a detector dropped out (the loader's 0.0): targets s0..s0+2
        series[s0 + 6, 3] = 0.0
    elif plant == "outage_in":  # one time step with no reading: inputs of windows s0+3..s0+6
        series[s0 + 6] = 0.0
    elif plant == "nan_fit":  # a NaN in the split the scaler is fitted on (0.0 in the windows)
        fit[2, 3] = float("nan")
    elif plant == "stuck":  # a sensor reporting one constant speed, in the fit too
        series[:, 1] = 65.0
        fit = series
    return M.windows(series), M.StandardScaler(fit)


def train(make: str, out_dir, loss_fn=M.masked_mae, plant: str | None = None,
          record: bool = True, autocast: torch.dtype | None = None, accumulate: int = 1,
          first: int = 1):
    """DCRNN's recipe: Adam (eps 1e-3) with a step decay, a curriculum over horizons (step
    ``k`` trains the first ``k + first``), the loss on inverse-transformed outputs against raw
    speeds, clip_grad_norm 5 (under float16 autocast with a GradScaler, unscaled before the
    clipping). Returns the model."""
    torch.manual_seed(0)  # (the decoder's scheduled sampling draws)
    model = getattr(M, make)()
    (x, y), scaler = dataset(plant)
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH // accumulate, shuffle=False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-3)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2], gamma=0.1)
    grads = torch.amp.GradScaler("cpu", enabled=autocast == torch.float16)
    rec = FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=out_dir, scaler=grads,
                         factory=f"traffic_forecasting_models:{make}") if record else None
    cast = torch.autocast("cpu", autocast) if autocast else contextlib.nullcontext()
    with rec if rec is not None else contextlib.nullcontext():
        crit = rec.loss_fn if rec is not None else loss_fn
        for i, (xb, yb) in enumerate(loader):
            step = i // accumulate
            xs = scaler.transform(xb)
            with cast:
                out = model(xs, scaler.transform(yb), step) if isinstance(model, M.DCRNN) \
                    else model(xs, xb[..., 0] != 0) if isinstance(model, M.AttentionForecaster) \
                    else model(xs)
            pred = scaler.inverse_transform(out.float())
            h = min(step + first, M.HORIZON)
            loss = crit(pred[:, :h], yb[:, :h]) / accumulate
            grads.scale(loss).backward()
            if (i + 1) % accumulate == 0:
                grads.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                grads.step(opt)
                grads.update()
                opt.zero_grad()
                sched.step()
    return model


def fire(make: str, tmp_path, **kw):
    with pytest.raises(NonFiniteError) as info:
        train(make, tmp_path, **kw)
    ev = info.value.event
    return (ev["step"], ev["phase"], ev["module"], ev["kind"]), info.value.bundle_path


def same_training(make: str, tmp_path, **kw):
    """No event, and the weights bit-identical with and without the recorder."""
    recorded = train(make, tmp_path, **kw)
    plain = train(make, tmp_path, record=False, **kw)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name
    return recorded


def origin_of(rep):
    o = rep["origin"]
    return rep["reproduced"], o["phase"], o["module"], o["op"], o["made"]


# ---------------------------------------------------------------------------------------------
# The road graph


def test_isolated_sensor_degree_zero_names_the_pow_and_the_degree_guard(tmp_path):
    """A detector far from every other, in a graph rebuilt without self-loops, has degree 0;
    ``random_walk`` without DCRNN's ``d_inv[isinf] = 0`` makes ``0 ** -1 = +inf`` in the
    model's own forward (then ``inf * 0`` NaN in ``D^-1 A``) at the first step. The replay
    names the pow, its line, and the degree guard, not the data."""
    ev, bundle = fire("make_dcrnn_isolated", tmp_path)
    assert ev == (0, "forward", "", "nan"), ev
    rep = nanreplay_json(bundle)
    assert origin_of(rep) == (True, "forward", "", "aten.pow", "+inf"), rep["origin"]
    assert rep["origin"]["source"] == line_of("d_inv = adj.sum(1).pow(-1)")
    assert [c["op"] for c in rep["origin"]["chain"]] == ["aten.pow", "aten.mul"]
    assert rep["cause"] == "invalid", rep["cause"]
    assert "isolated node" in rep["hint"] and "deg.clamp(min=1)" in rep["hint"], rep["hint"]


def test_guarded_random_walk_of_the_isolated_sensor_trains_the_same(tmp_path):
    """DCRNN's guard on the same graph (the +inf is filled before it is used): no event, and
    scheduled sampling draws the same coins with and without the recorder."""
    same_training("make_dcrnn_isolated_guarded", tmp_path)


def test_learned_edge_weights_of_an_isolated_sensor_name_the_pow_backward(tmp_path):
    """With learned edge weights the guarded ``D^-1 A`` is finite, but the degree is a
    function of parameters: the fill after the pow still sends ``0 * inf`` back into the
    degree, and every edge weight's gradient is NaN. The replay names PowBackward0 at the
    pow's line and says to make the base safe before the op."""
    ev, bundle = fire("make_dcrnn_learned_edges", tmp_path)
    assert ev == (0, "backward", None, "nan"), ev
    rep = nanreplay_json(bundle)
    assert origin_of(rep) == (True, "backward", "", "PowBackward0", "nan"), rep["origin"]
    assert rep["origin"]["source"] == line_of("d_inv = adj.sum(1).pow(-1)")
    assert rep["cause"] == "invalid", rep["cause"]
    assert "both branches" in rep["hint"] and "before the op" in rep["hint"], rep["hint"]


def test_learned_edge_weights_with_self_loops_train_the_same(tmp_path):
    same_training("make_dcrnn_learned_edges_clamped", tmp_path)


def test_adaptive_adjacency_of_a_new_sensor_masked_to_minus_inf_names_the_softmax(tmp_path):
    """Graph WaveNet's adaptive adjacency sparsified to its positive entries
    (``masked_fill(adp <= 0, -inf)``): a detector added with a zero embedding has a row of
    ``relu(0) = 0``, every entry -inf, and the softmax of that row is NaN. The masked_fill is
    named as intended, the softmax as the op, with the fully masked row's advice."""
    ev, bundle = fire("make_gwnet_positive", tmp_path)
    assert ev == (0, "forward", "", "nan"), ev
    rep = nanreplay_json(bundle)
    assert origin_of(rep) == (True, "forward", "", "aten._softmax", "nan"), rep["origin"]
    assert rep["origin"]["source"] == line_of("return F.softmax(adp, dim=1)")
    chain = rep["origin"]["chain"]
    assert [(c["op"], c.get("intentional", False)) for c in chain] == [
        ("aten.masked_fill", True), ("aten._softmax", False)], chain
    assert rep["cause"] == "invalid" and "every entry is -inf" in rep["hint"], rep["hint"]


def test_top_k_adaptive_adjacency_of_a_new_sensor_keeps_its_minus_inf_inside(tmp_path):
    """The top-k sparsification of the same graph: -inf in every row but k, in each forward,
    and a finite softmax. No event, the same weights."""
    same_training("make_gwnet_topk_new_sensor", tmp_path)


def test_degree_normalised_adaptive_adjacency_of_a_new_sensor_trains_the_same(tmp_path):
    """The adaptive adjacency normalised by its degree, guarded: the new sensor's pow(-1) is
    +inf and its backward NaN, which relu's backward drops (its input is 0 there): every
    parameter's gradient is finite, so no event, and the same weights."""
    same_training("make_gwnet_walk", tmp_path)


# ---------------------------------------------------------------------------------------------
# Missing readings and the masked losses


def test_batch_with_every_reading_missing_names_mask_mean_and_no_row(tmp_path):
    """A feed outage: every target reading of the last step is 0.0, ``mask.mean()`` is 0 and
    the masked MAE written without DCRNN's NaN guard divides 0 by 0. The loss event names
    the division of its line at every row, and the hint says no row is to blame: skip such
    batches (or clamp the count)."""
    ev, bundle = fire("make_dcrnn", tmp_path, loss_fn=M.unguarded_mae, plant="outage")
    assert ev == (3, "loss", "<loss>", "nan"), ev
    rep = nanreplay_json(bundle)
    assert origin_of(rep) == (True, "loss", "<loss>", "aten.div", "nan"), rep["origin"]
    assert rep["origin"]["source"] == line_of("mask = mask / torch.mean(mask)")
    assert rep["origin"]["samples"] == list(range(BATCH)), rep["origin"]
    assert rep["cause"] == "invalid", rep["cause"]
    assert "no row is to blame" in rep["hint"] and "skip such batches" in rep["hint"]


def test_dcrnn_masked_mae_on_the_outage_trains_the_same(tmp_path):
    """DCRNN's own masked MAE (NaN mask set to 0, then NaN loss set to 0): the outage batch's
    loss is 0 with finite gradients. No event, the same weights."""
    same_training("make_dcrnn", tmp_path, plant="outage")


def test_masked_rmse_on_the_outage_names_the_sqrt_backward_at_zero(tmp_path):
    """The guarded masked MSE is exactly 0 on the outage batch; the RMSE's sqrt of it is
    finite, its derivative ``1 / (2 sqrt(0))`` is not: every gradient is NaN. The replay names
    SqrtBackward0 in the loss at its line, over every row."""
    ev, bundle = fire("make_dcrnn", tmp_path, loss_fn=M.masked_rmse, plant="outage")
    assert ev == (3, "backward", None, "nan"), ev
    rep = nanreplay_json(bundle)
    assert origin_of(rep) == (True, "backward", "<loss>", "SqrtBackward0", "+inf"), rep
    assert rep["origin"]["source"] == line_of("return torch.sqrt(masked_mse(")
    assert rep["origin"]["samples"] == list(range(BATCH)), rep["origin"]
    assert rep["cause"] == "invalid", rep["cause"]
    assert "one 0-d value for the whole batch" in rep["hint"], rep["hint"]
    assert "no row is to blame" in rep["hint"] and "skip such batches" in rep["hint"]


def test_curriculum_starting_at_no_horizon_names_the_mean_of_an_empty_mask(tmp_path):
    """The curriculum's task level started at 0 instead of MTGNN's 1: the first step trains
    ``pred[:, :0]``, and the masked MAE's ``torch.mean`` of the empty mask is 0/0 before any
    reading is compared. The replay names the mean of an empty tensor on its line."""
    ev, bundle = fire("make_gwnet", tmp_path, first=0)
    assert ev == (0, "loss", "<loss>", "nan"), ev
    rep = nanreplay_json(bundle)
    assert origin_of(rep) == (True, "loss", "<loss>", "aten.mean", "nan"), rep["origin"]
    assert rep["origin"]["source"] == line_of("mask = mask / torch.mean(mask)")
    assert rep["cause"] == "invalid", rep["cause"]
    assert "of an empty tensor" in rep["hint"] and "empty selection" in rep["hint"]


def test_nan_in_the_raw_csv_is_an_input_event_on_the_windows_holding_it(tmp_path):
    """An empty cell read as NaN instead of the loader's 0.0: the z-score keeps it, and the
    input windows 3 to 6 of the last step hold it; a note names windows 0 to 2, which hold it
    in their targets, and the drop that removes every bad window."""
    ev, bundle = fire("make_dcrnn", tmp_path, plant="nan_csv")
    assert ev == (3, "input", "", "nan"), ev
    rep = nanreplay_json(bundle)
    assert (rep["reproduced"], rep["origin"]["phase"], rep["origin"]["samples"]) == (
        True, "input", [3, 4, 5, 6]), rep["origin"]
    assert rep["cause"] == "input" and "data pipeline" in rep["hint"], rep["hint"]
    # DCRNN takes the labels in forward too (teacher forcing), and windows 0 to 2 hold the NaN
    # there and in the loss's targets: dropping 3 to 6 alone would meet them
    assert ("args[1] in rows [0, 1, 2]; loss_args[1] in rows [0, 1, 2]; those records are bad "
            "as well (drop=0,1,2,3,4,5,6 removes every one)") in " ".join(rep["problems"])
    rep = nanreplay_json(bundle, "--try", "drop=0,1,2,3,4,5,6")
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_nan_in_a_target_only_is_skipped_by_dcrnn_masked_mae(tmp_path):
    """The CSV's last row cut short: a NaN in the last window's target only. DCRNN's masked
    MAE zeroes that term, and abs's backward there is ``0 * sgn(NaN) = 0``: no event (Graph
    WaveNet takes no labels in forward), the same weights."""
    same_training("make_gwnet", tmp_path, plant="truncated")


def test_nan_target_under_masked_rmse_is_the_targets_not_a_pole(tmp_path):
    """The same NaN target under the masked RMSE: the square's backward multiplies the 0
    entering it by ``2 (pred - NaN)``, so the gradients are NaN while the loss is finite. The
    loss took ``scaler.inverse_transform(out)``, a value the loop made of the model's output;
    the replay re-runs the loss on it and names PowBackward0 on sample 7, and the cause is the
    NaN target it saved (fill or select the targets first), not a pole of the square."""
    ev, bundle = fire("make_gwnet", tmp_path, loss_fn=M.masked_rmse, plant="truncated")
    assert ev == (3, "backward", None, "nan"), ev
    rep = nanreplay_json(bundle)
    assert origin_of(rep) == (True, "backward", "<loss>", "PowBackward0", "nan"), rep
    assert rep["origin"]["source"] == line_of("loss = (preds - labels) ** 2 * mask")
    assert rep["origin"]["samples"] == [BATCH - 1], rep["origin"]
    assert rep["cause"] == "input", (rep["cause"], rep["hint"])
    assert "rows [7] of loss_args[1]" in rep["hint"], rep["hint"]
    assert "torch.nan_to_num(y)" in rep["hint"], rep["hint"]


def test_zero_reading_under_mape_with_a_nan_null_names_the_division_on_its_windows(tmp_path):
    """Graph WaveNet's ``masked_mape`` called with its default ``null_val=np.nan``: a detector
    dropout stored as 0.0 is not masked, ``|pred - 0| / 0`` is +inf, which the NaN guard does
    not catch. The replay names the division at its line on the windows whose targets hold
    the 0 (0 to 2), a record the loss should skip."""
    ev, bundle = fire("make_dcrnn", tmp_path, loss_fn=M.mae_plus_mape_nan_null, plant="dropout")
    assert ev == (3, "loss", "<loss>", "+inf"), ev
    rep = nanreplay_json(bundle)
    assert origin_of(rep) == (True, "loss", "<loss>", "aten.div", "+inf"), rep["origin"]
    assert rep["origin"]["source"] == line_of("loss = torch.abs(preds - labels) / labels")
    assert rep["origin"]["samples"] == [0, 1, 2], rep["origin"]
    assert rep["cause"] == "invalid", rep["cause"]
    assert "computed from the batch's data alone" in rep["hint"], rep["hint"]
    # (the prediction the loop inverse-transformed is learned, not data: the divisor's advice)
    assert "leave them out of the loss (a mask of divisor > 0)" in rep["hint"], rep["hint"]


def test_stuck_sensor_zero_std_names_the_column_of_every_window(tmp_path):
    """A sensor reporting one constant speed: the scaler's std is 0 for it and the z-score is
    0/0 in its column of every window, from the first step. The input event names every row,
    and the hint the constant column's zero std (sensor 1 of dim 2)."""
    ev, bundle = fire("make_gwnet", tmp_path, plant="stuck")
    assert ev == (0, "input", "", "nan"), ev
    rep = nanreplay_json(bundle)
    assert rep["origin"]["samples"] == list(range(BATCH)), rep["origin"]
    assert rep["cause"] == "input", rep["cause"]
    assert "all at index 1 of dim 2" in rep["hint"], rep["hint"]
    assert "constant column's zero std" in rep["hint"], rep["hint"]


def test_scaler_fitted_on_a_nan_names_the_column_and_the_fit(tmp_path):
    """The scaler fitted with ``mean()``/``std()`` on a training split holding one NaN of
    sensor 3: its mean and std are NaN, so is that sensor's column in every window. The hint
    names the column and says to fit the statistics with nanmean/nanstd."""
    ev, bundle = fire("make_gwnet", tmp_path, plant="nan_fit")
    assert ev == (0, "input", "", "nan"), ev
    rep = nanreplay_json(bundle)
    assert rep["origin"]["samples"] == list(range(BATCH)), rep["origin"]
    assert rep["cause"] == "input", rep["cause"]
    assert "all at index 3 of dim 2" in rep["hint"], rep["hint"]
    assert "nanmean/nanstd" in rep["hint"], rep["hint"]


def test_healthy_dcrnn_and_bf16_graph_wavenet_with_accumulation_train_the_same(tmp_path):
    """Scheduled sampling's coins, Graph WaveNet's top-k -inf masks under bf16 autocast and
    two accumulated micro-batches per step: no event, the same weights."""
    same_training("make_dcrnn", tmp_path)
    same_training("make_gwnet", tmp_path, autocast=torch.bfloat16, accumulate=2)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_float16_dcrnn_with_a_grad_scaler_trains_the_same(tmp_path):
    """DCRNN under float16 autocast with a GradScaler (its first scale, 65536, overflows the
    half gradients and the scaler skips that step, so the schedule warns): no event, the same
    weights."""
    same_training("make_dcrnn", tmp_path, autocast=torch.float16)


def test_time_step_with_no_reading_names_the_fully_masked_spatial_attention(tmp_path):
    """Spatial attention over the sensors that reported: at a time step where every reading
    is missing every key is masked with -inf and the softmax is NaN, in the input windows
    that hold that step (3 to 6). The replay names the softmax in ``spatial`` on those rows,
    the masked_fill as intended, and the fully masked row's advice."""
    ev, bundle = fire("make_attention", tmp_path, plant="outage_in")
    assert ev == (3, "forward", "spatial", "nan"), ev
    rep = nanreplay_json(bundle)
    assert origin_of(rep) == (True, "forward", "spatial", "aten._softmax", "nan"), rep
    assert rep["origin"]["source"] == line_of("return h + torch.softmax(scores, -1) @ v")
    assert rep["origin"]["samples"] == [3, 4, 5, 6], rep["origin"]
    assert rep["cause"] == "invalid" and "large finite negative" in rep["hint"], rep["hint"]


def test_spatial_attention_with_a_finite_fill_trains_the_same_through_the_gap(tmp_path):
    same_training("make_attention_finite_fill", tmp_path, plant="outage_in")


def test_isolated_sensor_in_stgcn_laplacian_names_the_pow_behind_the_failed_eigh(tmp_path):
    """STGCN's scaled Laplacian without the guard: ``deg ** -0.5`` is +inf at the isolated
    detector, the Laplacian holds NaN, and ``eigvalsh`` for lambda_max raises LinAlgError. The
    recorder writes the step the exception ended; the replay names the pow behind it, not the
    decomposition, with the degree's advice."""
    with pytest.raises(torch.linalg.LinAlgError):
        train("make_stgcn_isolated", tmp_path)
    bundle, = tmp_path.glob("*.nan")
    rep = nanreplay_json(bundle)
    assert origin_of(rep) == (True, "forward", "", "aten.pow", "+inf"), rep["origin"]
    assert rep["origin"]["source"] == line_of("d_is = adj.sum(1).pow(-0.5)")
    assert rep["cause"] == "invalid" and "deg.clamp(min=1)" in rep["hint"], rep["hint"]
    assert any("aten._linalg_eigh raised on the +inf that aten.pow made" in p
               for p in rep["problems"]), rep["problems"]


def test_stgcn_on_the_connected_graph_trains_the_same(tmp_path):
    same_training("make_stgcn", tmp_path)


def test_nan_target_in_a_later_micro_batch_names_its_row_there(tmp_path):
    """Two accumulated micro-batches of 4 windows per step: the truncated row's NaN target is
    in the second micro-batch's row 3, and the replay names that micro-batch and row (not
    row 7 of a batch of 8), with the loop's inverse_transform said as the derived value."""
    ev, bundle = fire("make_gwnet", tmp_path, loss_fn=M.masked_rmse, plant="truncated",
                      accumulate=2)
    assert ev == (3, "backward", None, "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], o["micro_batch"], o["samples"], rep["cause"]) == (
        "PowBackward0", 1, [3], "input"), (o, rep["cause"])
    assert any("inverse_transform" in p for p in rep["problems"]), rep["problems"]
