"""End to end on species distribution models (``species_distribution_models``): presence-only
data as an inhomogeneous Poisson point process with background-point quadrature (and as
down-weighted Poisson regression), occupancy models with imperfect detection over camera-trap
visits from a DataLoader of sites, and a hierarchical multi-species model with a spatial
random effect fitted by LBFGS. Each planted bug of the domain (a NoData covariate, a zero
quadrature weight, a constant covariate's std of 0, a detection history's product underflowing
over many visits, ``log(1 - psi)`` of a saturated sigmoid) fires under the recorder and is
replayed with the CLI; the stable versions raise no event and train bit-identically with and
without the recorder."""

from __future__ import annotations

import contextlib

import pytest
import species_distribution_models as M
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("species_distribution_models.py", text)


def recording(model, opt, loss, make: str, out_dir, record: bool):
    if not record:
        return contextlib.nullcontext(), loss
    rec = FlightRecorder(model, opt, loss_fn=loss, out_dir=out_dir,
                         factory=f"species_distribution_models:{make}")
    return rec, rec.loss_fn


def train_ppp(make: str, loss: str, out_dir, bad: int | None = None, steps: int = 4,
              record: bool = True, **data):
    """Adam with a step schedule and gradient clipping over batches of presences and
    background points; ``bad`` planted in the last step's batch. Returns the model."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    g = torch.Generator().manual_seed(0)
    ctx, loss_fn = recording(model, opt, getattr(M, loss), make, out_dir, record)
    with ctx:
        for step in range(steps):
            x, y, w = M.presence_background(g, bad=bad if step == steps - 1 else None, **data)
            nll = loss_fn(model(x), y, w)
            opt.zero_grad()
            nll.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
    return model


def train_regional(out_dir, empty: int | None = None, steps: int = 4, record: bool = True):
    """The point process over four regions (each integral the region's mean intensity at its
    background points times its area); region ``empty`` has no background point in the last
    step's batch."""
    model = M.make_ppp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    ctx, loss_fn = recording(model, opt, M.regional_ppp_loss, "make_ppp", out_dir, record)
    with ctx:
        for step in range(steps):
            x, y, region, area = M.regional_points(g, empty=empty if step == steps - 1 else None)
            nll = loss_fn(model(x), y, region, area)
            opt.zero_grad()
            nll.backward()
            opt.step()
    return model


def sites(bad: int | None, batches: int = 4, **survey) -> torch.utils.data.TensorDataset:
    """A survey of ``batches`` x 32 sites; ``bad`` planted at that row of the last 32."""
    g = torch.Generator().manual_seed(0)
    parts = [M.camera_survey(g, bad=bad if i == batches - 1 else None, **survey)
             for i in range(batches)]
    return torch.utils.data.TensorDataset(*(torch.cat(p) for p in zip(*parts)))


def train_occupancy(make: str, loss: str, out_dir, bad: int | None = None,
                    record: bool = True, bf16: bool = False, lr: float = 1e-2, **survey):
    """Adam over a DataLoader of sites (32 a batch, in survey order), gradient clipping;
    ``bf16``: the model's forward under CPU autocast to bfloat16, the loss outside it."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    loader = torch.utils.data.DataLoader(sites(bad, **survey), batch_size=32)
    ctx, loss_fn = recording(model, opt, getattr(M, loss), make, out_dir, record)
    with ctx:
        for site_x, visit_x, y in loader:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logits = model(site_x, visit_x)
            nll = loss_fn(*logits, y)
            opt.zero_grad()
            nll.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
    return model


# bf16 autocast, and occupancy that follows the habitat covariate closely enough to saturate
BF16 = {"bf16": True, "lr": 0.05, "batches": 16, "habitat": 6.0}


def fire(train, *args, **kw):
    with pytest.raises(NonFiniteError) as info:
        train(*args, **kw)
    return info.value.event, info.value.bundle_path


def event_of(ev) -> tuple:
    return ev["step"], ev["phase"], ev["module"], ev["kind"]


def test_log_of_an_intensity_underflowed_at_a_nodata_covariate_says_log_exp_is_eta(tmp_path):
    """A presence whose temperature is the raster's NoData -9999: its log-intensity is about
    -800, ``exp`` underflows to 0 and the naive ``log(lam[presence])`` is -inf. The replay
    names the log, its line and sample 3, an underflow, and (the log takes a pick of exp's
    result) that log(exp(x)) is x: use the log-intensity itself."""
    ev, bundle = fire(train_ppp, "make_ppp", "ppp_loss_naive", tmp_path, bad=3, nodata=True)
    assert event_of(ev) == (3, "loss", "<loss>", "+inf"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "<loss>", "aten.log", "-inf", [3]), o
    assert o["source"] == line_of("return -torch.log(lam[pres]).sum()"), o
    assert rep["cause"] == "underflow", rep["cause"]
    assert "log(exp(x)) is x" in rep["hint"], rep["hint"]


def test_dwpr_presence_with_zero_weight_is_a_degenerate_record_of_its_sample(tmp_path):
    """Down-weighted Poisson regression's pseudo response ``z = y / w`` for a presence whose
    quadrature weight is 0 is +inf, and ``w * z`` is 0 * inf: the replay names the division
    and sample 3, computed from the data alone (no eps: repair the record's weight)."""
    ev, bundle = fire(train_ppp, "make_ppp", "dwpr_loss", tmp_path, bad=3)
    assert event_of(ev) == (3, "loss", "<loss>", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("<loss>", "aten.div", "+inf",
                                                                [3]), o
    assert o["source"] == line_of("z = y / w  # the bug"), o
    assert [c["op"] for c in o["chain"]] == ["aten.div", "aten.mul"], o["chain"]
    assert rep["cause"] == "invalid", rep["cause"]
    assert "data alone" in rep["hint"] and "drop or repair such records" in rep["hint"], rep


def test_region_without_background_points_is_an_empty_group_not_a_record(tmp_path):
    """A region whose background points a coastline mask clipped away: its count of
    background points in the batch is 0 and its mean intensity ``total / count`` is 0/0. The
    replay names the division and no sample (no record is to blame), and says the divisor is
    a per-group count by index_add, 0 at region 2: leave empty groups out, not an eps."""
    ev, bundle = fire(train_regional, tmp_path, empty=2)
    assert event_of(ev) == (3, "loss", "<loss>", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("<loss>", "aten.div", "nan",
                                                                []), o
    assert o["source"] == line_of("integral = area * total / count"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "accumulated per group by index_add" in rep["hint"], rep["hint"]
    assert "0 at group(s) [2]" in rep["hint"] and "leave the empty groups out" in rep["hint"]


def test_regions_each_with_background_points_raise_nothing_and_train_the_same(tmp_path):
    recorded = train_regional(tmp_path)
    plain = train_regional(tmp_path, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_batch_standardised_in_the_collate_fn_with_a_constant_column_is_the_pipelines(tmp_path):
    """A collate_fn standardising each batch with its own statistics; the last batch's 32
    cells share one land-cover value (a block of the same habitat): NaN in column 3 of every
    row of the model's input. The replay calls it the pipeline's per-feature step (a zero
    std), not a bad record."""
    model = M.make_ppp_unscaled()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y, w = M.presence_background(torch.Generator().manual_seed(0), n_pres=64, n_bg=64)
    x[96:, 3] = 0.3
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y, w),
                                         batch_size=32, collate_fn=M.standardise_batch)
    rec = FlightRecorder(model, opt, loss_fn=M.ppp_loss, out_dir=tmp_path,
                         factory="species_distribution_models:make_ppp_unscaled")
    with pytest.raises(NonFiniteError) as info, rec:
        for xb, yb, wb in loader:
            nll = rec.loss_fn(model(xb), yb, wb)
            opt.zero_grad()
            nll.backward()
            opt.step()
    assert event_of(info.value.event) == (3, "input", "", "nan"), info.value.event
    rep = nanreplay_json(info.value.bundle_path)
    assert (rep["cause"], rep["origin"]["all_samples"]) == ("input", True), rep["origin"]
    assert "column(s) 3" in rep["hint"] and "zero std" in rep["hint"], rep["hint"]


def test_covariate_constant_over_the_region_divides_every_site_by_its_zero_std(tmp_path):
    """A land-cover class absent from the whole study region: its column is 0 everywhere, the
    training set's std of it is 0 and standardisation is 0/0 for every point at the first
    step. The replay names the buffer ``scale.std`` at entry 4, no record to drop, and the
    floor of a zero scale."""
    ev, bundle = fire(train_ppp, "make_ppp_constant_cover", "ppp_loss", tmp_path, constant=4)
    assert event_of(ev) == (0, "forward", "scale", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["call"], o["op"], o["made"], o["all_samples"]) == (
        "scale", 0, "aten.div", "nan", True), o
    assert o["source"] == line_of("return (x - self.mean) / self.std"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]
    assert "scale.std" in rep["hint"] and "entry 4" in rep["hint"], rep["hint"]
    assert "std.clamp_min(eps)" in rep["hint"], rep["hint"]


def test_detection_history_product_over_sixty_visits_underflows_before_the_log(tmp_path):
    """A camera at a feeding station detects the species on 30 of 60 nights while detection
    is still rare (p ~ 0.02): ``prod p^y (1-p)^(1-y)`` is ~1e-52, 0 in float32, and the
    marginal likelihood's log is -inf for that site only. The replay names the log, site 5,
    an underflow, and that the 0 is the 60 visits' product: sum the logs, logaddexp."""
    ev, bundle = fire(train_occupancy, "make_occupancy_rare", "occupancy_nll_product",
                      tmp_path, bad=5, visits=60, busy=30, rate=0.05)
    assert event_of(ev) == (3, "loss", "<loss>", "+inf"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("<loss>", "aten.log", "-inf",
                                                                [5]), o
    assert o["source"] == line_of("return -torch.log(psi * hist"), o
    assert rep["cause"] == "underflow", rep["cause"]
    assert "product of 60 nonzero factors" in rep["hint"], rep["hint"]
    assert "logaddexp(log a + sum log p, log b)" in rep["hint"], rep["hint"]


def test_log_one_minus_saturated_psi_is_nan_in_backward_at_its_site(tmp_path):
    """A site whose covariates came in raw units (forest cover in %, elevation in metres) and
    was never detected: its occupancy logit is ~400, ``sigmoid`` rounds to 1, ``log(1 - psi)``
    is -inf, which ``logaddexp`` absorbs in the forward, but its backward is 0 * inf. The
    event is a backward one; the replay names ``LogBackward0`` at the line, site 5 only, and
    the stable complement logsigmoid(-z)."""
    ev, bundle = fire(train_occupancy, "make_occupancy", "occupancy_nll_log1m", tmp_path,
                      bad=5, extreme=True)
    assert (ev["step"], ev["phase"], ev["kind"]) == (3, "backward", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["made"], o["samples"]) == (
        "backward", "<loss>", "LogBackward0", "nan", [5]), o
    assert o["source"] == line_of("absent = torch.log(1 - psi)"), o
    assert rep["cause"] == "precision", rep["cause"]
    assert "log(1 − sigmoid(z)) = logsigmoid(−z)" in rep["hint"], rep["hint"]


def test_bf16_occupancy_psi_rounding_to_1_at_sites_with_detections_names_those_sites(tmp_path):
    """Under bf16 autocast ``sigmoid`` rounds to 1 from a logit of about 5.5: as occupancy
    tracks the habitat covariate, sites with good habitat reach it, ``log(1 - psi)`` is -inf
    there, and ``torch.where`` keeps only the occupied branch for sites with detections, so
    the forward is finite and the backward 0 * inf. The replay names the bf16 rounding, the
    stable form and the where, at the sites an unrecorded run shows rounded with detections."""
    ev, bundle = fire(train_occupancy, "make_occupancy", "occupancy_nll_log1m", tmp_path,
                      **BF16)
    assert (ev["step"], ev["phase"], ev["kind"]) == (15, "backward", "nan"), ev
    model = train_occupancy("make_occupancy", "occupancy_nll_log1m", None, record=False,
                            **{**BF16, "batches": 15})
    site_x, visit_x, y = sites(None, batches=16, habitat=6.0)[15 * 32:]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        psi = torch.sigmoid(model(site_x, visit_x)[0])
    expected = torch.nonzero((psi == 1) & (y.sum(1) > 0)).flatten().tolist()
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"]) == ("<loss>", "LogBackward0", expected), o
    assert expected and o["source"] == line_of("absent = torch.log(1 - psi)"), o
    assert rep["cause"] == "precision" and "in bfloat16" in rep["hint"], rep["hint"]
    assert "logsigmoid" in rep["hint"] and "torch.where(mask, safe, x)" in rep["hint"], rep


def test_visits_not_made_as_nan_masked_by_multiplication_name_the_mask_and_the_site(tmp_path):
    """An unbalanced design: site 5's last 3 visits were not made and are NaN in the history
    (as unmarked stores them); the likelihood multiplies the per-visit terms by the visits'
    mask, and NaN * 0 is NaN. The recorder stops at the loss's target (an input event); the
    replay names the multiplication's line, site 5 and the fill before the first read."""
    ev, bundle = fire(train_occupancy, "make_occupancy", "occupancy_nll_missing", tmp_path,
                      bad=5, missed=3)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (3, "input", "<loss>",
                                                                   "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["cause"], o["samples"]) == ("input", [5]), (rep["cause"], o)
    assert o["source"] == line_of("log_hist = (per_visit * done).sum(1)"), o
    assert "NaN * 0 is NaN" in rep["hint"] and "torch.nan_to_num(x)" in rep["hint"], rep


def test_unrecorded_saturated_psi_run_breaks_the_weights_silently(tmp_path):
    """The same run without the recorder: the loss is finite and the occupancy network's
    weights turn NaN, so the event above is the bug, not a false alarm."""
    model = train_occupancy("make_occupancy", "occupancy_nll_log1m", tmp_path, bad=5,
                            extreme=True, record=False)
    assert not torch.isfinite(model.occ[0].weight).all()


@pytest.mark.parametrize("train, make, loss, kw", [
    (train_ppp, "make_ppp", "ppp_loss", {"bad": 3, "nodata": True}),
    (train_occupancy, "make_occupancy", "occupancy_nll", {"bad": 5, "extreme": True}),
    (train_occupancy, "make_occupancy_rare", "occupancy_nll",
     {"bad": 5, "visits": 60, "busy": 30, "rate": 0.05}),
    (train_occupancy, "make_occupancy", "occupancy_nll", BF16),
], ids=["ppp-eta-as-is", "occupancy-logsumexp", "occupancy-logsumexp-many-visits",
        "occupancy-logsumexp-bf16"])
def test_stable_likelihoods_raise_nothing_and_train_the_same(tmp_path, train, make, loss, kw):
    """The fixed likelihoods on the same planted data: the intensity ``exp(-800)`` is 0 only
    in the background term (finite), the occupancy's unoccupied branch is ``-inf`` for every
    site with detections (a mask that stays inside logsumexp). No event, no bundle, and the
    weights are bit-identical with and without the recorder."""
    recorded = train(make, loss, tmp_path, **kw)
    plain = train(make, loss, tmp_path, record=False, **kw)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.isfinite(a).all() and torch.equal(a, b), name


def fit_multispecies(out_dir, record: bool = True, steps: int = 4,
                     make: str = "make_multispecies"):
    """LBFGS with a strong-Wolfe line search over the whole survey, the closure re-running
    the model and the loss (several forwards and backwards per step)."""
    model = getattr(M, make)()
    opt = torch.optim.LBFGS(model.parameters(), lr=1.0, max_iter=10,
                            line_search_fn="strong_wolfe")
    x, cell, y = M.survey(torch.Generator().manual_seed(0))
    ctx, loss_fn = recording(model, opt, M.joint_nll, make, out_dir, record)
    losses = []
    with ctx:
        for _ in range(steps):
            def closure():
                opt.zero_grad()
                nll = loss_fn(*model(x, cell), y)
                nll.backward()
                return nll
            losses.append(float(opt.step(closure).detach()))
    return model, losses


def test_lbfgs_hierarchical_model_raises_nothing_and_fits_the_same(tmp_path):
    recorded, seen = fit_multispecies(tmp_path)
    plain, expected = fit_multispecies(tmp_path, record=False)
    assert not list(tmp_path.glob("*.nan"))
    assert seen == expected and seen[-1] < seen[0], (seen, expected)
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def fit_ppp_lbfgs(out_dir, record: bool = True, etas: list | None = None):
    """The point process as a GLM is fitted in R: LBFGS over the whole data set, here at
    lr=8 and without a line search (torch's default); ``etas``: each closure call's
    log-intensity. Its fifth closure call (step 4) jumps a background point's log-intensity
    from at most 29.5 to 140, far past float32's exp range (88.72) on every CPU; at lr=1 the
    overshoot came some 65 calls in, after the kernels' rounding had parted the trajectories
    (an AMD EPYC's ``ATEN_CPU_CAPABILITY=default`` never overflowed there: LBFGS's own
    update made the parameters NaN first)."""
    model = M.make_ppp()
    opt = torch.optim.LBFGS(model.parameters(), lr=8.0, max_iter=20, history_size=10)
    x, y, w = M.presence_background(torch.Generator().manual_seed(0), n_bg=200)
    ctx, loss_fn = recording(model, opt, M.ppp_loss, "make_ppp", out_dir, record)
    with ctx:
        for _ in range(6):
            def closure():
                opt.zero_grad()
                eta = model(x)
                if etas is not None:
                    etas.append(eta.detach())
                nll = loss_fn(eta, y, w)
                nll.backward()
                return nll
            opt.step(closure)
    return model


def test_lbfgs_without_line_search_overflows_exp_and_the_hint_says_strong_wolfe(tmp_path):
    """LBFGS's quasi-Newton steps at full length (lr=8) overshoot until a background point's
    ``exp(eta)`` overflows at step 4. The recorder counts closure calls as steps; the replay names the
    exp at the points an unrecorded run's same closure call has past float32's exp range,
    a diverging run, and the line search (not clipping, which LBFGS does not do; nor the
    standardisation of the rainfall column in mm, which the model's buffers already do)."""
    ev, bundle = fire(fit_ppp_lbfgs, tmp_path)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (4, "loss", "<loss>", "+inf"), ev
    etas: list = []
    fit_ppp_lbfgs(None, record=False, etas=etas)  # (unrecorded it goes on, silently)
    eta = etas[ev["step"]]
    y = M.presence_background(torch.Generator().manual_seed(0), n_bg=200)[1]
    expected = torch.nonzero((eta > 88.72) & (y == 0)).flatten().tolist()
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"]) == ("aten.exp", "+inf", expected), o
    assert expected and o["source"] == line_of("(w[~pres] * eta[~pres].exp()).sum()"), o
    assert rep["cause"] == "overflow" and "the run was diverging" in rep["hint"], rep["hint"]
    assert 'line_search_fn="strong_wolfe"' in rep["hint"], rep["hint"]
    assert "standardise the columns" not in rep["hint"], rep["hint"]


def test_grid_cell_without_land_neighbours_names_the_adjacency_rows_of_degree_0(tmp_path):
    """The CAR prior's neighbour mean ``adjacency @ cell / deg`` over a coastline grid: the
    sea cells and the island between them have no land neighbour, a degree of 0 and a mean
    of 0/0 at the first step, in the model's own forward (no sample's data reaches it). The
    replay names the division, no sample, and the adjacency's rows of degree 0."""
    ev, bundle = fire(fit_multispecies, tmp_path, make="make_multispecies_island")
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (0, "forward", "", "nan"), ev
    deg = M.make_multispecies_island().adjacency.sum(1)
    isolated = torch.nonzero(deg == 0).flatten().tolist()
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("", "aten.div", "nan", []), o
    assert o["source"] == line_of("mean = self.adjacency @ self.cell / deg"), o
    assert rep["cause"] == "invalid" and "row sums of a 0/1 matrix" in rep["hint"], rep
    assert isolated == [2, 3, 7] and f"0 at row(s) {isolated}" in rep["hint"], rep["hint"]
