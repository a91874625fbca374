"""End to end on statistical downscaling of climate model output (``climate_downscaling_models``):
a conv super-resolution network from coarse reanalysis fields to fine precipitation and
temperature, the land-sea mask passed into ``forward``, a mass-conserving precipitation output
(each fine cell rescaled by its block's mean so the block averages to the coarse cell), inputs
standardised per variable by a climatological std, a ``cos(lat)``-weighted MSE of ``log1p``
precipitation, and a Bernoulli-Gamma head and likelihood (``lgamma``, softplus-positive shape and
scale); gradients accumulated over time slices, clipped, some runs under bf16 autocast. Each
planted failure fires under the recorder and is replayed with the CLI; the healthy versions
raise no event and train bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import climate_downscaling_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("climate_downscaling_models.py", text)


def train(make: str, crit, out_dir, bad: dict | None = None, steps: int = 3,
          record: bool = True, bf16: bool = False, adam_eps: float = 1e-8,
          land_loss: bool = False, **rec_kw):
    """Adam, gradients accumulated over the ``T`` time slices of each step and clipped; the
    data condition ``bad`` (keywords of ``climate_batch``) is planted in the last step."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=adam_eps)
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(1)  # (the Gamma draws of the coarse precipitation)
    gamma = isinstance(model, M.BernoulliGammaNet)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, **rec_kw,
                         factory=f"climate_downscaling_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for step in range(steps):
            opt.zero_grad()
            for _ in range(M.T):
                x, pr, land, y = M.climate_batch(g, **(bad if bad and step == steps - 1
                                                       else {}))
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    out = model(x, land) if gamma else model(x, pr, land)
                loss = loss_fn(out.float(), y, *([land] if land_loss else [])) / M.T
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    return model


def fire(make: str, crit, tmp_path, **kw):
    with pytest.raises(NonFiniteError) as info:
        train(make, crit, tmp_path, **kw)
    return info.value.event, info.value.bundle_path


def test_dry_coarse_cell_under_mass_conservation_without_eps_names_the_division(tmp_path):
    """A coarse cell with no rain: its fine cells are zeroed, the block's mean is 0, and the
    mass-conserving rescale ``fine * coarse / mean`` with an eps of 0 is 0/0 in sample 3."""
    ev, bundle = fire("make_downscale_noeps", M.lat_weighted_mse, tmp_path, bad={"dry": 3})
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (2, "forward", "conserve",
                                                                      [3]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "conserve", "aten.div", "nan", [3]), o
    assert o["source"] == line_of("return fine * coarse_up / (block_mean + self.eps)"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]
    assert "exactly 0" in rep["hint"], rep["hint"]


def test_dry_block_set_to_zero_by_where_after_the_division_names_its_backward(tmp_path):
    """The usual first fix, ``where(mean > 0, fine * coarse / mean, 0)``: the forward is
    finite, and the division's backward at the dry block's 0 mean is NaN (sample 3)."""
    ev, bundle = fire("make_downscale_where", M.lat_weighted_mse, tmp_path, bad={"dry": 3})
    assert (ev["step"], ev["phase"], ev["kind"]) == (2, "backward", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["samples"]) == (
        True, "conserve", "DivBackward0", [3]), o
    assert o["source"] == line_of("return torch.where(block_mean > 0, fine * coarse_up"), o
    assert rep["cause"] == "invalid" and "torch.where(mask, x, 1)" in rep["hint"], rep["hint"]


def test_all_sea_tile_under_a_land_only_loss_names_the_empty_record(tmp_path):
    """A loss over each tile's land cells (station targets exist on land only): tile 6 is all
    sea, and its ``sum / land.sum()`` is 0/0. The replay names that tile as a record with no
    valid entry and the land mask."""
    ev, bundle = fire("make_downscale", M.land_mse, tmp_path, bad={"ocean": 6}, land_loss=True)
    assert (ev["step"], ev["phase"], ev["module"]) == (2, "loss", "<loss>"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"]) == ("aten.div", "nan", [6]), o
    assert o["source"] == line_of("return (err.sum((1, 2, 3)) / land.sum((1, 2, 3))).mean()")
    assert rep["cause"] == "invalid" and "no valid entry" in rep["hint"], rep["hint"]
    assert "count.clamp_min(1)" in rep["hint"], rep["hint"]


def test_snow_cover_constant_over_the_domain_standardised_by_its_zero_std(tmp_path):
    """Snow cover is 0 over the whole domain in every training year: its climatological std is
    0 and the standardisation makes NaN in input channel 3 of every sample. The hint lists
    positions; it now says they are the whole channel (it listed 8 of 16 and '(+8)')."""
    ev, bundle = fire("make_downscale", M.lat_weighted_mse, tmp_path,
                      bad={"floor_std": False})
    assert (ev["step"], ev["phase"], ev["tensor"]) == (2, "input", "args[0]"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["cause"], o["tensor"], o["samples"]) == ("input", "args[0]", list(range(8)))
    assert "all at index 3 of dim 1, every one of its 16 positions (a whole channel" \
        in rep["hint"], rep["hint"]
    assert "constant column's zero std" in rep["hint"], rep["hint"]


def test_where_over_dry_cells_sends_the_log_of_zero_rain_into_the_backward(tmp_path):
    """``where(wet, wet_nll, dry_nll)`` with ``log(y)`` of every cell: the dry cells' -inf is
    dropped in the forward, and the product's backward multiplies it by the 0 the where sends:
    NaN in the shape's gradient at step 0, every sample having dry cells."""
    ev, bundle = fire("make_bgamma", M.BernoulliGammaLoss(), tmp_path)
    assert (ev["step"], ev["phase"], ev["kind"]) == (0, "backward", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["samples"]) == (
        True, "<loss>", "MulBackward0", list(range(8))), o
    assert o["source"] == line_of("wet_nll = (-torch.log(p) - (alpha - 1) * torch.log(y)")
    assert rep["cause"] == "invalid" and "made by aten.log" in rep["hint"], rep["hint"]
    assert "torch.where(mask, x, 1)" in rep["hint"], rep["hint"]


def test_pressure_file_in_pascal_overflows_the_exp_scale_of_the_gamma_head(tmp_path):
    """One sample's surface pressure in Pa, never standardised to the hPa climatology: the
    Gamma scale ``exp(b)`` overflows in the head, on sample 5, a wrong unit."""
    ev, bundle = fire("make_bgamma_exp", M.SafeBernoulliGammaLoss(), tmp_path,
                      bad={"pascal": 5})
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (2, "forward", "head",
                                                                      [5]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("head", "aten.exp", "+inf", [5])
    assert o["source"] == line_of("beta = torch.exp(b) if self.exp_scale"), o
    assert rep["cause"] == "overflow" and "a wrong unit" in rep["hint"], rep["hint"]


@pytest.mark.parametrize("mm,float64", [(150.0, "1.99e-111 in float64"),
                                        (900.0, "below float64's range as well")],
                         ids=["heavy", "cyclone"])
def test_gamma_density_written_out_underflows_on_extreme_rain(tmp_path, mm, float64):
    """The Gamma density written out, ``y^(a-1) exp(-y/b) / (b^a Gamma(a))``, then logged: at
    an extreme rain amount in sample 2 ``exp(-y / b)`` underflows and the log is -inf. At
    900 mm/day float64 underflows too; the product of an exp with factors > 0 is still
    positive in exact arithmetic (it said ``invalid``, "which exact arithmetic makes too")."""
    ev, bundle = fire("make_bgamma", M.gamma_pdf_loss, tmp_path,
                      bad={"cyclone": 2, "cyclone_mm": mm})
    assert (ev["step"], ev["phase"], ev["module"]) == (2, "loss", "<loss>"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("<loss>", "aten.log", "-inf",
                                                               [2]), o
    assert o["source"] == line_of("return -torch.log(lik).mean()"), o
    assert rep["cause"] == "underflow" and float64 in rep["hint"], rep["hint"]
    assert "exact arithmetic makes too" not in rep["hint"], rep["hint"]


def test_box_cox_of_conserved_precipitation_on_a_dry_cell_names_the_powers_backward(tmp_path):
    """Box-Cox with lambda 0.25 of the predicted precipitation, which the mass conservation
    makes exactly 0 under a dry coarse cell: the forward is finite, the power's derivative
    ``0.25 x^-0.75`` is infinite there, in sample 3."""
    ev, bundle = fire("make_downscale", M.BoxCoxMSE(0.25), tmp_path, bad={"dry": 3})
    assert (ev["step"], ev["phase"], ev["kind"]) == (2, "backward", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["samples"]) == (
        True, "<loss>", "PowBackward0", [3]), o
    assert o["source"] == line_of("pr = (pred[:, 0] ** self.lam - 1) / self.lam"), o
    assert rep["cause"] == "invalid" and "infinite derivative at x = 0" in rep["hint"]


def test_box_cox_at_lambda_zero_names_the_log_limit_not_a_setting_to_keep_off_zero(tmp_path):
    """Box-Cox with ``lam = 0``, the log member of the family: ``(y ** 0 - 1) / 0`` is 0/0 in
    every cell of every sample at step 0. The replay names the division on the target's line
    and the limit ``log(y)`` as the branch for lam = 0 (it said to keep the setting away from
    0, as for a temperature annealed to 0)."""
    ev, bundle = fire("make_downscale", M.BoxCoxMSE(0.0), tmp_path)
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "loss", "<loss>"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"]) == ("aten.div", "nan", list(range(8))), o
    assert o["source"] == line_of("target = (y[:, 0] ** self.lam - 1) / self.lam"), o
    hint = rep["hint"]
    assert rep["cause"] == "invalid" and "torch.log(y) if lam == 0" in hint, hint
    assert "keep it away from 0" not in hint, hint


def test_kelvin_fields_normalised_by_a_one_pass_variance_under_bf16(tmp_path):
    """Temperature fed in Kelvin, left to the network's per-field normalisation, whose
    variance ``E[x^2] - E[x]^2`` is computed in bf16 under autocast: it cancels below 0, and
    the sqrt is NaN in most samples. A precision loss, not invalid math."""
    ev, bundle = fire("make_downscale_norm", M.lat_weighted_mse, tmp_path,
                      bad={"kelvin_raw": True}, bf16=True)
    assert (ev["step"], ev["phase"], ev["module"]) == (2, "forward", "trunk.norm"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "trunk.norm", "aten.sqrt", "nan", [0, 2, 3, 4, 5, 7]), o
    assert o["source"] == line_of("return (h - mean) / torch.sqrt(var + 1e-5)"), o
    assert rep["cause"] == "precision" and "E[x²] − E[x]²" in rep["hint"], rep["hint"]


def test_cos_latitude_weights_of_a_global_grid_rounded_below_zero_at_the_poles(tmp_path):
    """``sqrt(cos(lat) / mean)`` on a grid whose rows reach ±90°: float32's cosine of the
    rounded pi/2 is -4.4e-8, and the weights' square root is NaN at step 0. A precision loss
    of a cosine at its zero (it gave a cancelled variance's advice): clamp at 0 or take the
    cells' centre latitudes."""
    ev, bundle = fire("make_downscale", M.GlobalLatMSE(), tmp_path)
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "loss", "<loss>"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"]) == ("aten.sqrt", "nan", []), o
    assert o["source"] == line_of("w = torch.sqrt(w / w.mean())[:, None]"), o
    hint = rep["hint"]
    assert rep["cause"] == "precision" and "a cosine or sine at one of its zeros" in hint, hint
    assert "clamp_min(0)" in hint and "E[x²]" not in hint, hint


def test_adam_without_eps_on_the_weights_of_an_all_zero_snow_channel(tmp_path):
    """Adam with ``eps=0``: the encoder's weights of the snow channel (0 everywhere after the
    floored standardisation) get gradients of exactly 0, and their first update is 0/0."""
    ev, bundle = fire("make_downscale", M.lat_weighted_mse, tmp_path, adam_eps=0.0)
    assert (ev["step"], ev["phase"], ev["params"]) == (0, "optimizer", ["trunk.enc.weight"]), ev
    rep = nanreplay_json(bundle, code=1)  # (the weights after the update: not re-run)
    assert rep["cause"] == "optimizer", rep["cause"]
    assert "trunk.enc.weight" in rep["hint"] and "eps=0" in rep["hint"], rep["hint"]
    assert "m = v = 0" in rep["hint"], rep["hint"]


def test_adam_without_eps_under_the_optimizer_guard_names_the_updates_division(tmp_path):
    """The same update re-run from the guard's copies: ``addcdiv_``'s ``m / (sqrt(v) + eps)``
    of 0 by 0 (it called it "of a negative number", the weights' sign, and read the update's
    domain as a root's)."""
    ev, bundle = fire("make_downscale", M.lat_weighted_mse, tmp_path, adam_eps=0.0,
                      guard_optimizer=True)
    assert (ev["step"], ev["phase"]) == (0, "optimizer"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["op"], o["param"], o["made"]) == (
        True, "aten.addcdiv_", "trunk.enc.weight", "nan"), o
    assert o["domain"].startswith("aten.addcdiv_ of 0 by 0 (0/0) in t1 / t2"), o["domain"]
    assert rep["cause"] == "optimizer" and "m = v = 0" in rep["hint"], rep["hint"]


def train_loader(out_dir, record: bool = True):
    """The downscaling network over a DataLoader of days of ``T`` time slices, under bf16
    autocast, gradients accumulated over the slices and clipped; returns the model."""
    data = M.ClimateSlices(dry=3)
    model = M.make_downscale()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(data, batch_size=M.B, shuffle=True,
                                         generator=torch.Generator().manual_seed(0))
    rec = FlightRecorder(model, opt, loss_fn=M.lat_weighted_mse, out_dir=out_dir,
                         factory="climate_downscaling_models:make_downscale") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else M.lat_weighted_mse
        for x, pr, land, y in loader:
            opt.zero_grad()
            for t in range(M.T):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = model(x[:, t], pr[:, t], land[:, t])
                loss = loss_fn(out.float(), y[:, t]) / M.T
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    return model


def assert_same(recorded, plain):
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_healthy_downscaling_over_a_dataloader_raises_nothing_and_trains_the_same(tmp_path):
    """Dry coarse cells under the eps-guarded mass conservation, bf16 autocast, accumulation
    over time slices: no event, and bit-identical weights with and without the recorder."""
    recorded = train_loader(tmp_path)
    plain = train_loader(tmp_path, record=False)
    assert not list(tmp_path.glob("*.nan"))
    assert_same(recorded, plain)


def test_healthy_bernoulli_gamma_on_extreme_rain_raises_nothing_and_trains_the_same(tmp_path):
    """The log-likelihood with its log taken of a filled copy of the rain amounts, on the
    900 mm/day cell: no event, bit-identical weights."""
    kw = {"bad": {"cyclone": 2}}
    recorded = train("make_bgamma", M.SafeBernoulliGammaLoss(), tmp_path, **kw)
    plain = train("make_bgamma", M.SafeBernoulliGammaLoss(), tmp_path, record=False, **kw)
    assert not list(tmp_path.glob("*.nan"))
    assert_same(recorded, plain)
