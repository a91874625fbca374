"""Optimal transport and soft dynamic programming as losses (``transport_models``): a point
cloud decoder trained through entropic OT (Sinkhorn in the plain and the log domain), and the
other relaxations research code writes by hand; the recorder on the loop, then ``nanreplay``
on its bundle as a user runs it."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
import transport_models as T
from bundles import nanreplay_json

from recorder import FlightRecorder, NonFiniteError

K, FAR = 3, 2  # the step a planted bug fires at, and the batch row that holds it


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def train_clouds(out_dir: Path, loss_fn, steps: int = 6, far_at: int | None = K,
                 radius: float | None = None, bf16: bool = False,
                 scale: float = 30.0) -> NonFiniteError | None:
    """The decoder fitted to target clouds through ``loss_fn``; at step ``far_at`` row
    ``FAR``'s target was recorded in other units (``scale`` times larger). ``radius``: pairs
    farther apart than it are forbidden (an infinite cost), as a matching restricted to
    nearby candidates writes it; ``bf16``: forward and loss under bfloat16 autocast."""
    model = T.make_decoder()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    try:
        with FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=out_dir,
                            factory="transport_models:make_decoder") as rec:
            for step in range(steps):
                z, y = T.point_batch(g, far=FAR if step == far_at else None, scale=scale)
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    out = model(z)
                    extra = () if radius is None else (torch.cdist(out.detach(), y) < radius,)
                    loss = rec.loss_fn(out, y, *extra)
                loss.backward()
                opt.step()
    except NonFiniteError as e:
        assert e.bundle_path is not None, e.write_error
        return e
    return None


def test_plain_sinkhorn_kernel_underflow_is_an_underflow_not_a_pole(tmp_path):
    """Sinkhorn-Knopp in the plain domain: row 2's costs are in centimetres, C / eps is in
    the thousands, every entry of its rows of K = exp(-C / eps) underflows to 0, and
    u = a / (K @ v) is a / 0. The report said 'invalid — aten.div by 0, which exact
    arithmetic makes too': the positivity of exp was lost through the matrix product. K @ v
    of a positive kernel and positive scalings is positive in exact arithmetic: an underflow,
    with log-space (logsumexp) advice; and dropping the row clears the step."""
    err = train_clouds(tmp_path, T.sinkhorn_loss)
    assert err is not None and (err.event["step"], err.event["phase"]) == (K, "loss")
    rep = nanreplay_json(err.bundle_path, "--try", "auto")
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == (
        "loss", "<loss>", "aten.div", "+inf", [FAR], "underflow"), json.dumps(rep, indent=1)
    assert "u = a / (K @ v" in rep["source_lines"][o["source"]]
    assert "logsumexp" in rep["hint"] and "exact arithmetic makes too" not in rep["hint"]
    assert [(t["try"], t["finite"]) for t in rep["what_if"]] == [(f"drop={FAR}", True)]


def test_bf16_sinkhorn_underflow_below_float32_too_is_not_sent_to_float32(tmp_path):
    """The same Sinkhorn under bfloat16 autocast, row 2 in other units (x3): K^T @ u is
    2e-109 in float64, rounded to 0 in bfloat16, whose range is float32's. ``--try auto``
    proposed dtype=float32, whose re-run was NaN again; the hint now says float32 would round
    it to 0 too, and auto tries only dropping the row."""
    err = train_clouds(tmp_path, T.sinkhorn_loss, bf16=True, scale=3.0)
    assert err is not None and (err.event["step"], err.event["phase"]) == (K, "loss")
    rep = nanreplay_json(err.bundle_path, "--try", "auto")
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"], rep["cause"]) == (
        "aten.div", "+inf", [FAR], "underflow"), json.dumps(rep, indent=1)
    assert "as float32 would too" in rep["hint"] and "float32 holds it" not in rep["hint"]
    assert [(t["try"], t["finite"]) for t in rep["what_if"]] == [(f"drop={FAR}", True)]


def test_log_sinkhorn_point_without_an_allowed_pair_blames_the_logsumexp(tmp_path):
    """Log-domain Sinkhorn with forbidden pairs costing +inf (a matching restricted to
    candidates within a radius): row 2's targets are all out of every point's reach, the
    logsumexp of its all -inf rows is -inf, f = +inf, and the next update's f - C is
    inf - inf. The report blamed that subtraction ('an infinity met another in arithmetic:
    find the op that made the first infinity'), whose chain's first infinity is the intended
    +inf fill. As in a model's forward, the reduction that folded the fill into -inf is blamed
    now: aten.logsumexp, a fully masked row, on row 2."""
    err = train_clouds(tmp_path, T.log_sinkhorn_loss, radius=3.0)
    assert err is not None and (err.event["step"], err.event["phase"]) == (K, "loss")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"], rep["cause"]) == (
        "aten.logsumexp", "-inf", [FAR], "invalid"), json.dumps(rep, indent=1)
    assert "f = eps * log_a - eps * torch.logsumexp" in rep["source_lines"][o["source"]]
    assert [c["op"] for c in o["chain"]] == ["aten.masked_fill", "aten.logsumexp"]
    assert "fully masked row" in rep["hint"] and "transport plan" in rep["hint"], rep["hint"]


def test_healthy_log_sinkhorn_with_far_clouds_raises_nothing(tmp_path):
    """The same centimetre row through the log-domain Sinkhorn without forbidden pairs: the
    logsumexp updates keep every potential finite where the plain kernel underflowed."""
    assert train_clouds(tmp_path, T.log_sinkhorn_loss) is None
    assert not list(tmp_path.rglob("*.nan"))


def train_forecaster(out_dir: Path, loss_fn, steps: int = 6) -> NonFiniteError | None:
    """A GRU forecaster trained with soft-DTW; at step ``K`` row ``FAR``'s future holds a
    sensor spike."""
    model = T.make_forecaster()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    try:
        with FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=out_dir,
                            factory="transport_models:make_forecaster"):
            for step in range(steps):
                past, future = T.series_batch(g, spike=FAR if step == K else None)
                opt.zero_grad()
                loss_fn(model(past), future).backward()
                opt.step()
    except NonFiniteError as e:
        assert e.bundle_path is not None, e.write_error
        return e
    return None


def test_soft_dtw_textbook_softmin_underflow_beside_inf_borders(tmp_path):
    """Soft-DTW with gamma = 0.1 and the textbook softmin -gamma * log(sum(exp(-r / gamma))):
    after row 2's spike every cell's r / gamma is in the thousands, the three exp underflow to
    0 and log(0) makes R +inf. The exp also takes R's +inf borders (exp(-inf) = 0, exactly),
    so the op finder did not mark it positive, and the report said 'invalid — aten.log of 0,
    which exact arithmetic makes too'. Positivity is now followed position by position (where
    exp's argument is not -inf, and a sum where any term is): an underflow, with the
    logsumexp advice. The max-shifted softmin of the same loss is finite."""
    err = train_forecaster(tmp_path, T.SoftDTW(gamma=0.1, stable=False))
    assert err is not None and (err.event["step"], err.event["phase"]) == (K, "loss")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"], rep["cause"]) == (
        "aten.log", "-inf", [FAR], "underflow"), json.dumps(rep, indent=1)
    assert "torch.log(r.exp().sum(-1))" in rep["source_lines"][o["source"]]
    assert "logsumexp" in rep["hint"] and "exact arithmetic makes too" not in rep["hint"]
    assert train_forecaster(tmp_path / "stable", T.SoftDTW(gamma=0.1)) is None


def test_unbalanced_ot_zero_weight_point_blames_the_kl_division(tmp_path):
    """Unbalanced OT between weighted clouds, row 2's predicted cloud padded (its last 4
    points weigh 0). The log domain takes a.log() = -inf for them on purpose, and exp gives
    their plan rows back as exact zeros; the primal KL's p / a is then 0 / 0. The report
    blamed the log ('clamp the op's input away from the pole'), whose -inf never reached the
    NaN; the NaN's maker took finite values only, so it is blamed now: aten.div, 0/0 in the
    KL, on row 2."""
    model = T.make_decoder()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=T.unbalanced_ot, out_dir=tmp_path,
                            factory="transport_models:make_decoder") as rec:
            for step in range(6):
                z, y, a, b = T.weighted_batch(g, pad_at=FAR if step == K else None)
                opt.zero_grad()
                rec.loss_fn(model(z), y, a, b).backward()
                opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (K, "loss")
    padded = [i for i, row in enumerate(a) if bool((row == 0).any())]  # (step K's weights)
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"], rep["cause"]) == (
        "aten.div", "nan", padded, "invalid"), json.dumps(rep, indent=1)
    assert "(p / q).log()" in rep["source_lines"][o["source"]]
    assert [c["op"] for c in o["chain"]] == ["aten.div"]  # (the log's -inf did not reach it)
    assert "0/0" in rep["hint"] and "clamp the op's input away" not in rep["hint"], rep["hint"]


def test_plain_sinkhorn_backward_overflow_near_a_tiny_kernel_sum_says_log_space(tmp_path):
    """With eps = 0.05 the first step's forward is finite, but backward through the unrolled
    scalings divides by (K^T @ u)² where K^T @ u is a tiny positive sum of exp: DivBackward0's
    gradient overflows float32 on row 0. The hint said to keep the input away from the pole
    with 'a larger eps, GaussianNLLLoss(eps=1e-6), y.clamp_min(1e-6)', for a denominator
    that no eps clamps. The matrix product's node now keeps exp's positivity (its saved
    factors), and the hint says log space (logsumexp)."""
    loss_fn = functools.partial(T.sinkhorn_loss, eps=0.05)
    err = train_clouds(tmp_path, loss_fn, far_at=None)
    assert err is not None and (err.event["step"], err.event["phase"]) == (0, "backward")
    model = T.make_decoder()  # the rows whose gradient is non-finite, computed here
    z, y = T.point_batch(torch.Generator().manual_seed(0))
    out = model(z).detach().requires_grad_()
    loss_fn(out, y).backward()
    rows = [i for i, g in enumerate(out.grad) if not bool(torch.isfinite(g).all())]
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"], rep["cause"]) == (
        "backward", "<loss>", "DivBackward0", rows, "overflow"), json.dumps(rep, indent=1)
    assert "logsumexp" in rep["hint"] and "GaussianNLLLoss" not in rep["hint"], rep["hint"]


def test_plain_sinkhorn_padded_points_zeros_are_exact_not_underflow(tmp_path):
    """The other side of the positivity above: a padded set whose kernel rows are zeroed by
    the validity mask (K * valid) and whose weights are 0 makes u = a / (K @ v) 0 / 0 at
    the padded points. Those zeros are exact (a 0/1 mask's, not an underflow of exp): invalid,
    on the padded row, not underflow."""
    model = T.make_decoder()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=T.sinkhorn_loss, out_dir=tmp_path,
                            factory="transport_models:make_decoder") as rec:
            for step in range(6):
                z, y = T.point_batch(g)
                valid = torch.ones(len(z), T.POINTS)
                if step == K:
                    valid[FAR, -3:] = 0  # a smaller set, padded to the decoder's size
                opt.zero_grad()
                rec.loss_fn(model(z), y, valid).backward()
                opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (K, "loss")
    padded = [i for i, row in enumerate(valid) if bool((row == 0).any())]
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"], rep["cause"]) == (
        "aten.div", "nan", padded, "invalid"), json.dumps(rep, indent=1)
    assert "u = a / (K @ v" in rep["source_lines"][o["source"]] and "0/0" in rep["hint"]


def test_banded_soft_dtw_custom_backward_inf_minus_inf_is_not_a_pole(tmp_path):
    """Soft-DTW with a Sakoe-Chiba band as a custom autograd.Function (pytorch-softdtw-cuda's
    CPU kernels), its backward missing the kernel's 'R[i, j] = -inf where R is +inf': the
    cells outside the band keep R's +inf, and exp((R[i+1, j] - R[i, j] - D) / gamma) is
    exp(inf - inf) on every row at the first step. The report named the node and its
    aten.sub, but the hint read 'multiplied a +Inf it saved in the forward:
    _bandedsoftdtw at its pole, in a branch masked before the output': now the backward's
    own inf - inf on the saved +inf, and what to set there."""
    err = train_forecaster(tmp_path, T.BandedSoftDTW(band=2), steps=2)
    assert err is not None and (err.event["step"], err.event["phase"]) == (0, "backward")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"], rep["cause"]) == (
        "backward", "<loss>", "_BandedSoftDTWBackward", list(range(4)), "invalid"), \
        json.dumps(rep, indent=1)
    assert "aten.sub computed inf - inf" in rep["hint"] and "pole" not in rep["hint"], \
        rep["hint"]
    assert any("a = torch.exp((R[:, i + 1, j] - R[:, i, j]" in n for n in rep["problems"]), \
        rep["problems"]
